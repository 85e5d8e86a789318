"""Print the tables of benchmarks/README.md from the JSON files benchmarks/run_all.sh wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt(value: float | None) -> str:
    """A bench figure, or n/a where bench recorded null (the bandwidth floor does not apply: all in cache)."""
    return "n/a" if value is None else f"{value:.2f}"


def main(out: Path) -> None:
    print(
        "| precision | file MB | bytes/step MB | prefill 128 ms (x FLOP floor) | decode ms/token med / p90 "
        "| floor ms (probe GB/s) | x floor (best run) | sampler ms | tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in ("fp32", "fp32-shared", "fp16", "int8", "int8-shared", "int4", "int4-shared"):
        p = out / f"bench-{mode}.json"
        if not p.exists():
            continue
        r = json.loads(p.read_text())
        print(
            f"| {mode} | {r['model_bytes'] / 1e6:.1f} | {r['bytes_read_per_step'] / 1e6:.1f} "
            f"| {r['prefill_ms']:.0f} ({r['prefill_vs_floor']:.2f}x) "
            f"| {r['decode_ms_per_token']:.2f} / {r['decode_ms_p90']:.2f} "
            f"| {fmt(r['decode_floor_ms'])} ({r['machine_read_bandwidth_gbs']:.1f}) | {fmt(r['decode_vs_floor'])} "
            f"({fmt(r['decode_vs_floor_best_run'])}) "
            f"| {r['sampler_ms_per_token']:.3f} | {r['tokens_per_s']:.1f} |"
        )
        if "torch" in r:
            t = r["torch"]
            torch_row = f"| PyTorch eager ({t['torch']}) | | | {t['prefill_ms']:.0f} | {t['decode_ms_per_token']:.2f} "
            print(torch_row + "| | | | |")
    for variant in ("fp32", "fp32-shared"):
        sweep = out / f"sweep-{variant}.json"
        if sweep.exists():
            rows = json.loads(sweep.read_text())["sweep"]
            print(f"\n| context | {variant} decode ms/token |\n|---|---|")
            for row in rows:
                print(f"| {row['context']} | {row['decode_ms_per_token']:.2f} |")
            ratio = rows[-1]["decode_ms_per_token"] / rows[0]["decode_ms_per_token"]
            print(f"\n{variant}: ratio last/first context: {ratio:.2f}")
    for name in ("quantize-int8.json", "quantize-int4.json", "quantize-fp16.json"):
        p = out / name
        if p.exists():
            q = json.loads(p.read_text())["quality"]
            print(f"{name}: KL {q['mean_kl']:.2e} top1 {q['top1_agreement']:.3f} greedy {q['greedy_match']}/64")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench"))
