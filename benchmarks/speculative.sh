#!/usr/bin/env bash
# Reproduce the "Speculative decoding" figures of benchmarks/README.md: trained-gpt2-py and the GPT-2 small
# shape (random weights), fp32 targets with a --head tail, int4 drafts and prompt lookup, code prompts.
#   bash benchmarks/speculative.sh [OUT_DIR] [ROUNDS]     (default out/spec, 3 rounds; ~1 hour on 2 cores)
# Prompts: the first 128 tokens of three of this repository's Python files. Each bench alternates plain and
# speculative decoding on the same target; run on an otherwise idle machine (every figure is a latency).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
out=${1:-out/spec}
rounds=${2:-3}
mkdir -p "$out"
py=../shared/trained-gpt2-py
tok=()
[ -f ../shared/gpt2-tokenizer/vocab.json ] && tok=(--tokenizer ../shared/gpt2-tokenizer)
[ -d "$out/small-ckpt" ] || gpt2edge random-checkpoint "$out/small-ckpt" --size small "${tok[@]}"
for name in py small; do
    src=$py; [ "$name" = small ] && src=$out/small-ckpt
    [ -d "$src" ] || { echo "skipping $name: $src is missing" >&2; continue; }
    [ -d "$out/$name-tail-shared" ] || gpt2edge export -m "$src" "$out/$name-tail-shared" --head tail --kv-cache shared
    [ -d "$out/$name-tail" ] || gpt2edge export -m "$src" "$out/$name-tail" --head tail
    [ -d "$out/$name-shared" ] || gpt2edge export -m "$src" "$out/$name-shared" --kv-cache shared
    [ -d "$out/$name-int4-shared" ] || gpt2edge quantize "$out/$name-shared" -o "$out/$name-int4-shared" --mode int4
done
text=(--text gpt2edge/runtime/decoding/generate.py --text gpt2edge/runtime/decoding/sampling.py
      --text gpt2edge/runtime/model/kv_cache.py)
run() {  # NAME ARGS...: one bench record
    local name=$1; shift
    gpt2edge bench "$@" --prompt-len 128 --new-tokens 120 --repeat 3 --threads 2 --json > "$out/$name-$round.json"
}
for round in $(seq "$rounds"); do
    for name in py small; do
        [ -d "$out/$name-tail-shared" ] || continue
        run "$name-lookup" "$out/$name-tail-shared" --prompt-lookup 3 "${text[@]}"
        run "$name-int4" "$out/$name-tail-shared" --draft "$out/$name-int4-shared" "${text[@]}"
        run "$name-concat-lookup" "$out/$name-tail" --prompt-lookup 3 "${text[@]}"
        run "$name-lookup-sample" "$out/$name-tail-shared" --prompt-lookup 3 --sample "${text[@]}"
        run "$name-int4-sample" "$out/$name-tail-shared" --draft "$out/$name-int4-shared" --sample "${text[@]}"
        for m in shared tail-shared; do  # plain decoding: the tail head costs what the last-position head does
            gpt2edge bench "$out/$name-$m" --prompt-len 128 --new-tokens 120 --repeat 3 --threads 2 --json \
                > "$out/plain-$name-$m-$round.json"
        done
    done
    [ -d "$out/small-tail" ] && python benchmarks/spec_rollback_cost.py "$out/small-tail" > "$out/rollback-$round.json"
done
