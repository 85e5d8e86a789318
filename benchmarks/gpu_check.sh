#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install the gpu extra (onnxruntime-gpu instead of onnxruntime), run the
# parity tests on CUDA, and print decode ms/token of a GPT-2-small-shaped (124M, random weights) model on
# CUDA and on the CPU. Prints everything to stdout; about 3-5 minutes on a fresh machine.
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu_check}
bash scripts/setup.sh --gpu
. .venv/bin/activate
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
python -m pytest -q -p no:cacheprovider tests/runtime/test_cuda.py tests/runtime/test_runtime.py -k "cuda" -rs
gpt2edge random-checkpoint "$out/ckpt" --size small --force
gpt2edge export -m "$out/ckpt" "$out/fp32" --force
gpt2edge quantize "$out/fp32" -o "$out/fp16" --mode fp16 --force
for variant in fp32 fp16; do
    echo "=== $variant on cuda"
    gpt2edge bench "$out/$variant" --device cuda --repeat 5
done
echo "=== fp32 on cpu"
gpt2edge bench "$out/fp32" --device cpu --repeat 3
