#!/usr/bin/env bash
# The main job on the model this repository ships: models/gpt2-stdlib-mini, a small GPT-2 trained by
# scripts/train_demo_model.py on CPython's standard library with the real GPT-2 BPE (its README says what it
# is and is not). It is exported to ONNX and validated against PyTorch, quantized to int8 with a quality
# report on Python code it never saw, generates Python-looking code on ONNX Runtime (fp32 and int8), decodes
# with prompt-lookup speculation, and ends with the bench table.
#   bash scripts/demo.sh [OUT_DIR]        (default out/demo; DEMO_MODEL=DIR: another checkpoint folder)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out=${1:-out/demo}
model=${DEMO_MODEL:-models/gpt2-stdlib-mini}
# a standard-library file the training held out (one in 50 by sorted path: scripts/train_demo_model.py), for the
# quality report and as the speculative prompt
text="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/asyncio/tasks.py"
echo "--- $model: a 7M-parameter GPT-2 trained on CPython's standard library; it writes Python-looking code ---"
gpt2edge export -m "$model" "$out/fp32" --force
gpt2edge quantize "$out/fp32" -o "$out/int8" --mode int8 --text "$text" --force
echo "--- generating: fp32, then int8 (same seed) ---"
# sampled with a repetition penalty: greedy decoding of a model this small collapses into runs of spaces (GPT-2's
# BPE spends one token per space of indentation; models/gpt2-stdlib-mini/README.md)
prompt=$'import os\nimport sys\n\n\ndef'
sample=(-n 64 --do-sample --temperature 0.6 --top-k 40 --repetition-penalty 1.2 --seed 8)
gpt2edge generate "$out/fp32" -p "$prompt" "${sample[@]}"
gpt2edge generate "$out/int8" -p "$prompt" "${sample[@]}"
echo "--- speculative decoding (prompt lookup, greedy): continuing a file that repeats its own names ---"
gpt2edge export -m "$model" "$out/fp32-tail" --head tail --no-validate --force
head -c 1100 "$text" > "$out/prompt.py"
gpt2edge generate "$out/fp32-tail" --prompt-file "$out/prompt.py" --truncate -n 48 --greedy --repetition-penalty 1.2 \
    --prompt-lookup 3
echo "--- bench (fp32) ---"
gpt2edge bench "$out/fp32" --prompt-len 128 --new-tokens 64 --repeat 3
