#!/usr/bin/env bash
# Reproduce "Speculative decoding on int8 / int4 targets" of benchmarks/README.md: trained-gpt2-py and the
# GPT-2 small shape (random weights), --head tail exports quantized to int8 / int4 (default recipe of this
# CPU), prompt lookup, and an int4 draft of the same model for the int8 target; code-continuation prompts.
#   bash benchmarks/speculative_quantized.sh [OUT_DIR]     (default out/qspec; ~10 min on 2 cores)
# Each `gpt2edge bench` record holds, from one run: plain and speculative ms/token of the same target
# (alternating, same prompts) and the target's read floor (bytes of a decode step / read bandwidth probed in
# that run; none when the step's bytes fit in the last-level cache). Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
out=${1:-out/qspec}
mkdir -p "$out"
shared=${SHARED:-../shared}  # from a git worktree elsewhere: SHARED=/path/to/shared
py=$shared/trained-gpt2-py
tok=()
[ -f "$shared/gpt2-tokenizer/vocab.json" ] && tok=(--tokenizer "$shared/gpt2-tokenizer")
[ -d "$out/small-ckpt" ] || gpt2edge random-checkpoint "$out/small-ckpt" --size small "${tok[@]}"
for name in py small; do
    src=$py; [ "$name" = small ] && src=$out/small-ckpt
    [ -d "$src" ] || { echo "skipping $name: $src is missing" >&2; continue; }
    [ -d "$out/$name-tail-shared" ] || gpt2edge export -m "$src" "$out/$name-tail-shared" --head tail --kv-cache shared
    [ -d "$out/$name-shared" ] || gpt2edge export -m "$src" "$out/$name-shared" --kv-cache shared
    for m in int8 int4; do
        [ -d "$out/$name-tail-shared-$m" ] ||
            gpt2edge quantize "$out/$name-tail-shared" -o "$out/$name-tail-shared-$m" --mode "$m" --no-report
    done
    [ -d "$out/$name-tail-shared-int4-acc1" ] ||  # float compute: verify rounds as decode does (speculative.md)
        gpt2edge quantize "$out/$name-tail-shared" -o "$out/$name-tail-shared-int4-acc1" --mode int4 \
            --accuracy-level 1 --no-report
    [ -d "$out/$name-int4-shared" ] || gpt2edge quantize "$out/$name-shared" -o "$out/$name-int4-shared" --mode int4 --no-report
done
text=(--text gpt2edge/runtime/decoding/generate.py --text gpt2edge/runtime/decoding/sampling.py
      --text gpt2edge/runtime/model/kv_cache.py)
run() {  # NAME ARGS...: one bench record
    local name=$1; shift
    gpt2edge bench "$@" --prompt-len 128 --new-tokens 120 --repeat 3 --threads 2 --json > "$out/$name.json"
}
lscpu | grep 'Model name' > "$out/cpu.txt"
for name in py small; do
    [ -d "$out/$name-tail-shared" ] || continue
    for m in int8 int4; do
        run "$name-$m-lookup" "$out/$name-tail-shared-$m" --prompt-lookup 3 "${text[@]}"
    done
    run "$name-int4acc1-lookup" "$out/$name-tail-shared-int4-acc1" --prompt-lookup 3 "${text[@]}"
    run "$name-int8-int4draft" "$out/$name-tail-shared-int8" --draft "$out/$name-int4-shared" "${text[@]}"
done
python - "$out" <<'PY'
import json, sys
from pathlib import Path
def ms(x):
    return "-" if x is None else f"{x:.2f}"
for f in sorted(Path(sys.argv[1]).glob("*-*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:22} plain {ms(r['plain_ms_per_token'])} spec {ms(r['speculative_ms_per_token'])} ms/token"
          f" x{r['speedup']:.2f} floor {ms(r['decode_floor_ms'])} plain/floor {ms(r['plain_vs_floor'])}"
          f" spec/floor {ms(r['speculative_vs_floor'])} acceptance {r['acceptance_rate']:.2f}"
          f" identical {r['greedy_identical']}")
PY
