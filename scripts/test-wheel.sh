#!/usr/bin/env bash
# The wheel lane: gpt2edge as a pip user gets it. Builds the wheel from a copy of the tree without node_modules
# (so the build hook's `npm ci` from web/package-lock.json runs), installs it in a fresh venv in a temp folder
# (torch==2.13.0 first, as scripts/setup.sh does, then the wheel with its export and serve extras; pip's cache
# is reused), and from a temp folder away from the source tree runs export -> quantize -> generate -> serve
# (one completion) -> convert --format web -> the page in headless Chromium, which must generate the tokens the
# installed Python runtime generates.
#   bash scripts/test-wheel.sh            (needs npm, a C compiler, /usr/bin/chromium; setup.sh installs them)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpt2edge-wheel.XXXXXX")
server_pid=""
cleanup() {
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
say() { echo "--- wheel lane: $* ---"; }

# 1. the wheel, from the files git would commit (tracked and untracked-not-ignored), not from this checkout's
# node_modules or build/ leftovers
say "building the wheel"
mkdir -p "$work/src" "$work/dist"
(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$work/src" 2>/dev/null) \
    || (cd "$repo" && git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do
            [ -e "$f" ] && cp --parents -t "$work/src" "$f"; done)
"$PY" -m pip wheel --no-deps --quiet --disable-pip-version-check -w "$work/dist" "$work/src" 2>"$work/pip.err" \
    || { cat "$work/pip.err"; exit 1; }
wheel=$(ls "$work"/dist/gpt2edge-*.whl)
echo "$(basename "$wheel"): $(du -h "$wheel" | cut -f1)"

# 2. a fresh venv with the wheel (never the checkout: no -e, no PYTHONPATH)
say "installing it in a fresh venv"
unset PYTHONPATH VIRTUAL_ENV PYTHONHOME
"$PY" -m venv "$work/venv"
vpy="$work/venv/bin/python"
# pip's own errors are shown; its warnings about this machine's index configuration are not
pip_q() { "$vpy" -m pip install -q --disable-pip-version-check "$@" 2>"$work/pip.err" || { cat "$work/pip.err"; exit 1; }; }
pip_q torch==2.13.0
pip_q "$wheel[export,serve]"
export PATH="$work/venv/bin:$PATH"

mkdir "$work/run"
cd "$work/run"
# the package comes from the venv, with its web runtime and native step
"$vpy" - "$work/venv" <<'EOF'
import sys
from pathlib import Path
import gpt2edge
from gpt2edge.convert.web import web_package_dir
from gpt2edge.runtime.sparse_head import native
venv = Path(sys.argv[1]).resolve()
where = Path(gpt2edge.__file__).resolve()
assert venv in where.parents, f"gpt2edge imported from {where}, not from the venv {venv}"
assert venv in web_package_dir().resolve().parents, f"web runtime at {web_package_dir()}, not in the wheel"
assert native.LIBRARY is not None, "the wheel has no native sparse step (_certify)"
print(f"gpt2edge {gpt2edge.__version__} from {where.parent}; web runtime and native step in the wheel")
EOF

model=${GPT2EDGE_WHEEL_MODEL:-$repo/models/gpt2-stdlib-mini}  # the shipped demo model (a checkpoint folder)
say "export, quantize, generate"
gpt2edge export -m "$model" fp32
gpt2edge quantize fp32 -o int8 --mode int8 --no-report
gpt2edge generate int8 -p "import os" -n 24 --do-sample --temperature 0.8 --top-k 40 --seed 1

say "serve: one completion"
port=$("$vpy" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
gpt2edge serve int8 --host 127.0.0.1 --port "$port" > serve.log 2>&1 &
server_pid=$!
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat serve.log; exit 1; }
    sleep 0.5
done
reply=$(curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "def main():", "max_tokens": 12, "temperature": 0}')
"$vpy" -c "import json, sys; r = json.loads(sys.argv[1]); t = r['choices'][0]['text']; \
assert r['usage']['completion_tokens'] > 0 and t, r; print('completion:', repr(t))" "$reply"
kill "$server_pid"
wait "$server_pid" 2>/dev/null || true
server_pid=""

say "convert --format web, the page in headless Chromium"
gpt2edge convert int8 -o web --format web
"$vpy" - "$repo" "$work/run/web" <<'EOF'
import sys
from pathlib import Path
repo, folder = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(repo / "tests" / "support"))  # the browser driver (web_helpers: a static server, browser.mjs)
from web_helpers import StaticServer, job_url, run_browser  # noqa: E402
from gpt2edge.runtime import Generator  # noqa: E402
prompt = "import os\n"
with StaticServer(folder) as server:
    pages = run_browser([job_url(server.url, "/report", prompt, max_new_tokens=16, temperature=0)], timeout_s=180)
    report = server.reports.get("/report", [None])[0]
assert pages and pages[0]["done"], pages
assert report is not None and "error" not in report, report
py = Generator(folder).generate(prompt, max_new_tokens=16, temperature=0)
assert report["token_ids"] == py.token_ids, (report["token_ids"], py.token_ids)
print(f"page ({report['device']}, {report['threads']} threads) generated {report['text']!r}, as Python does")
EOF
say "passed"
