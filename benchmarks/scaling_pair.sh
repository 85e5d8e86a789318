#!/usr/bin/env bash
# scaling_pair.sh FOLDER GGUF [ROUNDS]: one gpt2edge folder against llama.cpp on the same weights, order alternating
# per round: `gpt2edge bench` (prompt 128, 128 new, 2 threads) and `llama-bench -p 128 -n 128 -t 2`. Prints per
# round: ours decode ms/token, prefill ms, the read floor ms and the probe's GB/s; llama's decode ms/token and
# prefill ms. Run it under the bench lock with nothing else running (e.g. `flock /tmp/bench.lock chrt -f 10 ...`).
# LLAMA_BENCH: the llama-bench binary (default: ../shared/peers' build at /work/peers/llama-build/bin).
set -euo pipefail
folder=$1 gguf=$2 rounds=${3:-6}
llama=${LLAMA_BENCH:-/work/peers/llama-build/bin/llama-bench}
here=$(cd "$(dirname "$0")/.." && pwd)
ours() {
    "$here/.venv/bin/gpt2edge" bench "$folder" --threads 2 --repeat 1 --json 2>/dev/null | python3 -c "
import json, sys; r = json.load(sys.stdin)
print('ours', round(r['decode_ms_per_token'], 2), round(r['prefill_ms']), round(r['decode_floor_ms'], 1),
      round(r['machine_read_bandwidth_gbs'], 1), flush=True)"
}
theirs() {
    "$llama" -m "$gguf" -p 128 -n 128 -t 2 -r 1 -o json 2>/dev/null | python3 -c "
import json, sys; r = json.load(sys.stdin)
print('llama', *[round(1e3 / x['avg_ts'], 2) if x['n_gen'] else round(128e3 / x['avg_ts']) for x in r][::-1], flush=True)"
}
for r in $(seq 1 "$rounds"); do
    echo "round $r $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    if [ $((r % 2)) -eq 1 ]; then ours; theirs; else theirs; ours; fi
done
