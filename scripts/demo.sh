#!/usr/bin/env bash
# The main job on an offline default: a seeded random-weight GPT-2 (no download is possible here) is exported
# to ONNX and validated against PyTorch, quantized to int8 with a quality report, generates text on ONNX
# Runtime, and ends with the bench table. Its weights are random, so the text is gibberish; the pipeline, the
# parity table and the timings are real.
#   bash scripts/demo.sh [OUT_DIR]        (default out/demo)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out=${1:-out/demo}
# said first: every report below (validation, quality, generated text) is of random weights
echo "--- random weights: the generated text is gibberish; the parity tables, quality figures and timings are real ---"
gpt2edge random-checkpoint "$out/checkpoint" --size mini --force
gpt2edge export -m "$out/checkpoint" "$out/fp32" --force
gpt2edge quantize "$out/fp32" -o "$out/int8" --mode int8 --force
echo "--- generating (random weights: expect gibberish) ---"
gpt2edge generate "$out/fp32" -p "The weather today" -n 48 --do-sample --temperature 0.8 --top-p 0.9 --seed 7
gpt2edge generate "$out/int8" -p "The weather today" -n 48 --do-sample --temperature 0.8 --top-p 0.9 --seed 7
echo "--- bench (fp32) ---"
gpt2edge bench "$out/fp32" --prompt-len 128 --new-tokens 64 --repeat 3
