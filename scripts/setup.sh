#!/usr/bin/env bash
# Set up .venv with everything gpt2edge needs (export, runtime, tests). Idempotent: re-running is quick.
#   bash scripts/setup.sh          CPU (onnxruntime)
#   bash scripts/setup.sh --gpu    CUDA (onnxruntime-gpu instead of onnxruntime; never both)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
# torch first, pinned: an unpinned torch (directly or through transformers) pulls a multi-GB CUDA build
python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null || pip_q torch==2.13.0
if [ "${1:-}" = "--gpu" ]; then
    pip_q --no-deps -e .
    pip_q numpy tokenizers click tqdm transformers onnx onnxscript safetensors pytest ruff scipy matplotlib \
        fastapi uvicorn httpx 'ray[serve]' llguidance jsonschema
    python -m pip uninstall -q -y onnxruntime 2>/dev/null || true
    pip_q --force-reinstall --no-deps onnxruntime-gpu
else
    python -c "import importlib.metadata as m; m.version('onnxruntime-gpu')" 2>/dev/null \
        && { echo "onnxruntime-gpu is installed in .venv; remove .venv or run with --gpu" >&2; exit 1; }
    # genai: onnxruntime-genai (tests of `convert --format genai`); it depends on the CPU onnxruntime, so CPU only
    # cluster = serve + ray[serve], so the server and Ray tests run
    # structured: llguidance (constraints: JSON Schema, regex, grammars)
    pip_q -e '.[export,cluster,dev,genai,structured]'
fi

# the browser target (`convert --format web`, tests/web/): the JS runtime's npm packages, pinned by
# web/package-lock.json, and Debian's chromium for the headless tests (never a browser that a tool downloads)
if command -v npm >/dev/null 2>&1; then
    lock=web/node_modules/.package-lock.json
    if [ ! -f "$lock" ] || [ web/package-lock.json -nt "$lock" ]; then
        (cd web && npm ci --no-audit --no-fund --loglevel=error)
    fi
else
    echo "setup.sh: npm not found; install Node.js 20+ for the browser target (convert --format web)" >&2
fi
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
    else
        echo "setup.sh: /usr/bin/chromium is missing (the browser tests need it): sudo apt-get install chromium" >&2
    fi
fi
