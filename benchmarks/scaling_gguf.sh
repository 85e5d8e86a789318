#!/bin/bash
# GGUF F32 / Q8_0 / Q4_0 of each random-weight GPT-2 size, for benchmarks/scaling.py's llama.cpp columns.
# The method of ../shared/peers/setup.sh: convert_hf_to_gguf.py on a copy of the checkpoint whose config.json
# has n_ctx (transformers 5 configs do not), F32 first, then llama-quantize from F32.
# Usage: benchmarks/scaling_gguf.sh CKPT_ROOT SIZE...   (CKPT_ROOT/ckpt-SIZE made by `gpt2edge random-checkpoint`)
# Env: SCRATCH (/work/peers; llama.cpp built there by the peers setup), OUT ($SCRATCH/scale)
set -euo pipefail
ROOT=$1; shift
SCRATCH=${SCRATCH:-/work/peers}
OUT=${OUT:-$SCRATCH/scale}
G2E_PY=${G2E_PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
CONVERT=$(ls "$SCRATCH"/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py | head -1)
QUANTIZE=$SCRATCH/llama-build/bin/llama-quantize
mkdir -p "$OUT"
for size in "$@"; do
    ck=$ROOT/ckpt-$size
    gg=$OUT/ckpt-gguf-$size
    if [ ! -f "$OUT/gpt2-$size-f32.gguf" ]; then
        rm -rf "$gg"; mkdir -p "$gg"
        for f in "$ck"/*; do ln -s "$(readlink -f "$f")" "$gg/"; done  # the weights linked, not copied
        rm "$gg/config.json"
        "$G2E_PY" -c "import json,sys; c=json.load(open(sys.argv[1])); c['n_ctx']=c['n_positions']; json.dump(c, open(sys.argv[2],'w'), indent=2)" "$ck/config.json" "$gg/config.json"
        "$G2E_PY" "$CONVERT" "$gg" --outtype f32 --outfile "$OUT/gpt2-$size-f32.gguf.tmp" > "$OUT/convert-$size.log" 2>&1
        mv "$OUT/gpt2-$size-f32.gguf.tmp" "$OUT/gpt2-$size-f32.gguf"
        rm -rf "$gg"
    fi
    for q in Q8_0 Q4_0; do
        l=$(echo $q | tr A-Z a-z)
        [ -f "$OUT/gpt2-$size-$l.gguf" ] || {
            "$QUANTIZE" "$OUT/gpt2-$size-f32.gguf" "$OUT/gpt2-$size-$l.gguf.tmp" $q 2 > "$OUT/quantize-$size-$l.log" 2>&1
            mv "$OUT/gpt2-$size-$l.gguf.tmp" "$OUT/gpt2-$size-$l.gguf"
        }
    done
    echo "gguf $size: $(ls -la "$OUT"/gpt2-$size-*.gguf | awk '{printf "%s %.0f MB; ", $NF, $5/1e6}')"
done
