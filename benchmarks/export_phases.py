"""Peak RSS of each phase of `gpt2edge export`, in one process: /proc/self/status at every phase boundary, the
peak (VmHWM) reset between phases through /proc/self/clear_refs (Linux).

    python benchmarks/export_phases.py CHECKPOINT OUT [--kv-cache shared|concat] [--imports]

--imports first imports the heavy libraries one by one, to show the fixed cost of each.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import time
from pathlib import Path

T0 = time.time()


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile in MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) // 1024
    return out


def mark(name: str) -> None:
    """Print the peak since the last mark and the RSS now, then reset the peak."""
    s = status()
    print(
        f"{time.time() - T0:7.1f}s {name:<28} peak {s['VmHWM']:6d} MiB  now {s['VmRSS']:6d} "
        f"(anon {s['RssAnon']}, file {s['RssFile']})",
        flush=True,
    )
    Path("/proc/self/clear_refs").write_text("5")


def wrap(module, name: str) -> None:
    """Mark when module.name returns."""
    f = getattr(module, name)

    @functools.wraps(f)
    def marked(*a, **k):
        result = f(*a, **k)
        mark(name)
        return result

    setattr(module, name, marked)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out", type=Path)
    ap.add_argument("--kv-cache", default="shared", choices=["shared", "concat"])
    ap.add_argument("--imports", action="store_true")
    args = ap.parse_args()
    mark("start")
    if args.imports:
        for m in ("numpy", "onnxruntime", "onnx", "torch", "transformers", "onnxscript", "torch.onnx"):
            importlib.import_module(m)
            mark(f"import {m}")
    ex = importlib.import_module("gpt2edge.export.exporter")
    em, og, ev = (importlib.import_module(f"gpt2edge.export.{m}") for m in ("model", "onnx_graph", "validate"))
    mark("import gpt2edge.export")
    for module, name in [
        (ex, "load_checkpoint"), (em, "from_hf_model"), (og, "export_graph"), (ev, "reference_outputs"),
        (ex, "release_model"), (ev, "validate_against"), (og, "inline_small"), (ex, "write_manifest"),
    ]:  # fmt: skip
        wrap(module, name)
    # release_model's mark comes before the caller drops the old checkpoint: its freeing shows in the next phase
    ex.export_model(args.checkpoint, args.out, kv_cache=args.kv_cache, force=True, log=None)
    mark("end")


if __name__ == "__main__":
    main()
