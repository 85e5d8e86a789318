#!/usr/bin/env bash
# Set up .venv and run the test suite (CPU; CUDA tests skip where the CUDA provider is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check gpt2edge tests benchmarks
python -m pytest -q "$@"
