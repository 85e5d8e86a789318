#!/usr/bin/env bash
# Reproduce benchmarks/README.md: GPT-2 small shape (124M, random weights), batch 1, 2 threads.
#   bash benchmarks/run_all.sh [OUT_DIR]     (default out/bench; ~15 minutes on 2 cores)
# Uses ../shared/gpt2-tokenizer (the real GPT-2 vocabulary) when present, else a trained stand-in with the
# same 50,257-row embedding. Run it on an otherwise idle machine: every figure is a latency.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
out=${1:-out/bench}
mkdir -p "$out"
tok=()
[ -f ../shared/gpt2-tokenizer/vocab.json ] && tok=(--tokenizer ../shared/gpt2-tokenizer)
[ -d "$out/ckpt" ] || gpt2edge random-checkpoint "$out/ckpt" --size small "${tok[@]}"
[ -d "$out/fp32" ] || gpt2edge export -m "$out/ckpt" "$out/fp32"
[ -d "$out/fp32-shared" ] || gpt2edge export -m "$out/ckpt" "$out/fp32-shared" --kv-cache shared
for mode in int8 int4 fp16; do
    [ -d "$out/$mode" ] || gpt2edge quantize "$out/fp32" -o "$out/$mode" --mode "$mode" --json > "$out/quantize-$mode.json"
done
for mode in int8 int4; do
    [ -d "$out/$mode-shared" ] || gpt2edge quantize "$out/fp32-shared" -o "$out/$mode-shared" --mode "$mode" --no-report
done
gpt2edge bench "$out/fp32" --threads 2 --vs-torch --json > "$out/bench-fp32.json"
for variant in fp32-shared int8 int8-shared int4 int4-shared fp16; do
    gpt2edge bench "$out/$variant" --threads 2 --json > "$out/bench-$variant.json"
done
for variant in fp32 fp32-shared; do
    gpt2edge bench "$out/$variant" --threads 2 --repeat 5 --prompt-len 32 --new-tokens 16 --sweep \
        --plot "$out/sweep-$variant.png" --json > "$out/sweep-$variant.json"
done
python benchmarks/int8_methods.py "$out/fp32" --threads 2 --repeat 3 > "$out/int8-methods.txt"
python benchmarks/kernel_floor.py --threads 2 > "$out/kernel-floor.txt"
python benchmarks/summarize.py "$out"
