#!/usr/bin/env bash
# Set up .venv, check the code (ruff) and the docs (mkdocs build --strict), run the test suite (CPU; CUDA tests
# skip where the CUDA provider is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check gpt2edge tests benchmarks
# the docs site: a broken link or anchor, or a page left out of the nav, fails (mkdocs.yml: validation); built into
# a temp folder, never into the repository (README.md's own links: tests/docs/test_docs_links.py)
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
python -m mkdocs build --strict --site-dir "$site"   # not --quiet: it hides the warnings --strict counts
python -m pytest -q "$@"
