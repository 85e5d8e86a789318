"""Build the folders benchmarks/kv_dtype.py times: a random GPT-2 checkpoint of SIZE, its int4 variant per graph kind
(concat, shared), and each with an fp16 and an int8 KV cache (gpt2edge.quantize.kv, hard-linked copies rewritten).

    python benchmarks/kv_dtype_build.py small|xl ROOT
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from gpt2edge.export import export_model, make_random_checkpoint
from gpt2edge.manifest import load_manifest
from gpt2edge.quantize import make_recipe, quantize_model
from gpt2edge.quantize.kv import compact_kv_cache, twin_folder


def main(size: str, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / f"{size}-ckpt"
    if not ckpt.exists():
        make_random_checkpoint(ckpt, size=size, seed=0)
    for kind in ("concat", "shared"):
        fp32, int4 = root / f"{size}-{kind}-fp32", root / f"{size}-{kind}-int4"
        if not int4.exists():
            if not fp32.exists():
                export_model(str(ckpt), fp32, kv_cache=kind, run_validation=False, log=None)
            quantize_model(fp32, int4, make_recipe("int4"), report=False)
            shutil.rmtree(fp32)
        for kv in ("float16", "int8"):
            out = root / f"{size}-{kind}-int4-{kv}"
            if out.exists():
                continue
            twin = twin_folder(int4)  # hard links: no bytes copied; the rewrite replaces the graph file
            compact_kv_cache(twin, dict(load_manifest(twin).raw), kv, report=False)
            twin.rename(out)
    if ckpt.exists():
        shutil.rmtree(ckpt)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
