#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install the gpu extra (onnxruntime-gpu instead of onnxruntime), run the
# parity tests on CUDA, and print decode ms/token of a GPT-2-small-shaped (124M, random weights) model on
# CUDA and on the CPU. Prints everything to stdout; about 3-5 minutes on a fresh machine.
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# Offline (a machine that cannot reach PyPI but whose python already holds torch, transformers, onnx, click,
# tokenizers and an onnxruntime with the CUDA provider, e.g. onnxruntime-gpu unpacked on PYTHONPATH):
#   GPU_CHECK_PYTHON=python3 bash benchmarks/gpu_check.sh [OUT_DIR]
# uses that python as it is, from this checkout, and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu_check}
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    py=$GPU_CHECK_PYTHON
    command -v "$py" >/dev/null || { echo "gpu_check: GPU_CHECK_PYTHON=$py: no such python" >&2; exit 1; }
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    "$py" -c "import onnxruntime" 2>/dev/null || { echo "gpu_check: $py cannot import onnxruntime" >&2; exit 1; }
    "$py" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" \
        || { echo "gpu_check: $py's onnxruntime has no CUDA provider" >&2; exit 1; }
else
    bash scripts/setup.sh --gpu
    . .venv/bin/activate
    py=python
fi
g2e() { "$py" -m gpt2edge.cli "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$py" -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers(), 'torch', torch.__version__)"
# every test marked cuda (parity against PyTorch, the device-resident cache, beams, the shared cache)
"$py" -m pytest -q -p no:cacheprovider -m cuda -rs \
    tests/runtime/test_cuda.py tests/runtime/test_runtime.py tests/runtime/test_beam.py tests/runtime/test_shared_cache.py
g2e random-checkpoint "$out/ckpt" --size small --force
g2e export -m "$out/ckpt" "$out/fp32" --force
g2e quantize "$out/fp32" -o "$out/fp16" --mode fp16 --force
for variant in fp32 fp16; do
    echo "=== $variant on cuda"
    g2e bench "$out/$variant" --device cuda --repeat 5
done
echo "=== fp32 on cpu"
g2e bench "$out/fp32" --device cpu --repeat 3
