#!/usr/bin/env bash
# The main job on an offline default: a seeded random-weight GPT-2 (no download possible here) is exported to
# ONNX and validated against PyTorch, then generates text on ONNX Runtime. Its weights are random, so the
# text is gibberish; the pipeline, the parity table and the timings are real.
#   bash scripts/demo.sh [OUT_DIR]        (default out/demo)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out=${1:-out/demo}
gpt2edge random-checkpoint "$out/checkpoint" --size mini --force
gpt2edge export -m "$out/checkpoint" "$out/fp32" --force
echo "--- generating (random weights: expect gibberish) ---"
gpt2edge generate "$out/fp32" -p "The weather today" -n 48 --temperature 0.8 --top-p 0.9 --seed 7
