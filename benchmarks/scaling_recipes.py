"""The recipes of `quantize --target` on this CPU: each target's int4 and int8 variant of one fp32 export,
benched interleaved (gpt2edge bench: batch 1, prompt 128, 128 new tokens) under the bench lock.

    python benchmarks/scaling_recipes.py FP32_DIR WORK_DIR [--rounds 3] [--threads 2] [--targets ...]
        [--extra int4:block_size=128 int4:head_bits=4 int8:matmulinteger ...]

`--extra` adds single levers next to the targets' recipes: MODE:OPTION=VALUE[,OPTION=VALUE] (make_recipe's
options over the native target's, e.g. block_size, head_bits, symmetric, accuracy_level), or
int8:matmulinteger (ONNX Runtime's quantize_dynamic: per-tensor int8 MatMulInteger, which ONNX Runtime fuses
to DynamicQuantizeMatMul at load, benchmarks/int8_methods.py).

Prints the CPU (name, flags, what the probes found it runs), then per variant decode ms/token and prefill ms
as median [min..max] over rounds, and the ratio to the native target's variant of the same mode per round.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_lock import LOCK  # noqa: E402
from int8_methods import dynamic_int8  # noqa: E402
from scaling import gpt2edge_bench, median_range  # noqa: E402

from gpt2edge.quantize import make_recipe, quantize_model  # noqa: E402
from gpt2edge.quantize.targets import TARGETS, detect  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fp32", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--targets", nargs="+", default=list(TARGETS))
    ap.add_argument("--extra", nargs="*", default=[], help="MODE:OPTION=VALUE[,...] or int8:matmulinteger")
    args = ap.parse_args()
    cpu = detect()
    print(f"CPU: {json.dumps(cpu.to_json())}", file=sys.stderr)
    variants = {}
    for mode in ("int4", "int8"):
        seen = {}
        for target in [cpu.target, *(t for t in args.targets if t != cpu.target)]:
            recipe = {k: v for k, v in make_recipe(mode, target=target).to_json().items() if k != "target"}
            if json.dumps(recipe, sort_keys=True) in seen:  # the same recipe as another target's: benched once
                print(f"{mode} {target}: same recipe as {seen[json.dumps(recipe, sort_keys=True)]}", file=sys.stderr)
                continue
            seen[json.dumps(recipe, sort_keys=True)] = target
            out = args.work / f"{mode}-{target}"
            if not (out / "manifest.json").exists():
                quantize_model(args.fp32, out, make_recipe(mode, target=target), report=False, log=None)
            variants[(mode, target)] = out
    for spec in args.extra:
        mode, _, options = spec.partition(":")
        out = args.work / f"{mode}-{options.replace('=', '').replace(',', '-')}"
        if not (out / "manifest.json").exists():
            if options == "matmulinteger":
                dynamic_int8(args.fp32, out)
            else:
                kw = {k: int(v) for k, v in (o.split("=") for o in options.split(","))}
                quantize_model(args.fp32, out, make_recipe(mode, target=cpu.target, **kw), report=False, log=None)
        variants[(mode, options)] = out
    times: dict[tuple[str, str], list[dict]] = {k: [] for k in variants}
    for rnd in range(args.rounds):
        keys = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
        for key in keys:
            with open(LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                r = gpt2edge_bench(variants[key], args.threads, 1)
            times[key].append(r)
            print(f"round {rnd} {key}: {r['decode_ms_per_token']:.2f} ms/tok, prefill {r['prefill_ms']:.0f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
    print("| mode | target | decode ms/tok | ÷ native (per round) | prefill ms | ÷ native | file MB |")
    print("|---|---|---|---|---|---|---|")
    for (mode, target), rs in times.items():
        base = times[(mode, cpu.target)]
        dec = [r["decode_ms_per_token"] for r in rs]
        pre = [r["prefill_ms"] for r in rs]
        rd = [d / b["decode_ms_per_token"] for d, b in zip(dec, base)]
        rp = [p / b["prefill_ms"] for p, b in zip(pre, base)]
        print(
            f"| {mode} | {target} | {median_range(dec)} | {median_range(rd)} | {median_range(pre)} | "
            f"{median_range(rp)} | {rs[0]['model_bytes'] / 1e6:.0f} |"
        )
    (args.work / "recipes.json").write_text(json.dumps({"cpu": cpu.to_json(), "times": {
        f"{m}/{t}": v for (m, t), v in times.items()}}, indent=1))  # fmt: skip
    print(f"median of {statistics.median([args.rounds])} rounds; host shared", file=sys.stderr)


if __name__ == "__main__":
    main()
