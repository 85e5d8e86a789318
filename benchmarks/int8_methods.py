"""Which int8 kernel is fastest on this CPU? ONNX Runtime's dynamic quantization vs 8-bit MatMulNBits.

    python benchmarks/int8_methods.py FP32_EXPORT_DIR [--threads 2] [--repeat 5]

Builds both int8 variants of an fp32 export in a temp folder and benches them with `gpt2edge bench`'s
workload (prompt 128, 128 new tokens, batch 1) in one run, next to the fp32 model. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from gpt2edge.bench import BenchConfig, run_bench
from gpt2edge.manifest import load_manifest, write_manifest
from gpt2edge.quantize import make_recipe, quantize_model


def dynamic_int8(src: Path, out: Path) -> Path:
    """ORT quantize_dynamic (per-tensor int8 weights, int8 activations computed at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out.mkdir()
    manifest = dict(load_manifest(src).raw)
    for name in manifest["files"]:
        if name != manifest["graph"]["file"]:
            shutil.copy2(src / name, out / name)
    quantize_dynamic(
        src / manifest["graph"]["file"],
        out / manifest["graph"]["file"],
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul", "Gemm"],
        extra_options={"MatMulConstBOnly": True},
    )
    # "int8": the manifest's precisions are fp32/fp16/int8/int4 (the record of how is the graph itself)
    manifest["graph"] = {**manifest["graph"], "precision": "int8", "files": [manifest["graph"]["file"]]}
    manifest["graph"].pop("decode_weight_bytes", None)
    write_manifest(out, {k: v for k, v in manifest.items() if k != "files"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fp32_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--with-level0", action="store_true", help="also MatMulNBits accuracy_level 0 (very slow here)")
    args = ap.parse_args()
    cfg = BenchConfig(threads=args.threads, repeat=args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        variants = {
            "fp32": args.fp32_dir,
            "int8 ORT dynamic (MatMulInteger)": dynamic_int8(args.fp32_dir, tmp / "dynamic"),
        }
        for level in (0, 4) if args.with_level0 else (4,):
            out = tmp / f"nbits{level}"
            quantize_model(args.fp32_dir, out, make_recipe("int8", accuracy_level=level), report=False)
            variants[f"int8 MatMulNBits accuracy_level {level}"] = out
        rows = {}
        for name, path in variants.items():
            r = run_bench(path, cfg)
            rows[name] = {k: r[k] for k in ("model_bytes", "prefill_ms", "decode_ms_per_token", "decode_ms_p90")}
    print(f"{'variant':<38} {'MB':>7} {'prefill ms':>11} {'decode ms/tok':>14}")
    for name, r in rows.items():
        print(f"{name:<38} {r['model_bytes'] / 1e6:7.1f} {r['prefill_ms']:11.1f} {r['decode_ms_per_token']:14.2f}")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
