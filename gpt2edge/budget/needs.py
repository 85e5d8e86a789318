"""Memory and disk a request will need, estimated from the model's shape and checked before any work starts.

The factors are peak RSS / weight bytes measured with /usr/bin/time -v on gpt2 small..xl shapes
(benchmarks/README.md, "The GPT-2 family"), rounded up; FIXED is the interpreter with torch, onnx and ONNX
Runtime imported. MemAvailable counts the page cache the kernel can drop, which is what these runs reuse.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from gpt2edge.errors import ResourceError

GB = 1e9
FIXED = 0.7 * GB  # python + torch + transformers + onnx + onnxruntime imported, tokenizer loaded
# peak RSS per fp32 weight byte, on top of FIXED
EXPORT = 1.3  # one copy of the weights (the checkpoint's, shared by the exporter), then ONNX Runtime's
EXPORT_NO_VALIDATE = 1.1
QUANTIZE_REPORT = 1.2  # the quality report's fp32 session (lean: no prepacked copies; large measured 0.9)
QUANTIZE_NO_REPORT = 0.4  # streamed: the variant being built, one fp32 matrix at a time (fp16: ~0.2 measured)
RANDOM_CHECKPOINT = 1.3


def n_parameters(config: dict) -> int:
    """Parameters of a GPT-2 config (tied head counted once)."""
    C, L = config["n_embd"], config["n_layer"]
    inner = config.get("n_inner") or 4 * C
    V, P = config["vocab_size"], config.get("n_positions", config.get("n_ctx", 1024))
    per_layer = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * inner + inner) + (inner * C + C)
    return V * C + P * C + L * per_layer + 2 * C


def checkpoint_weight_bytes(folder: Path) -> int | None:
    """fp32 bytes of a local checkpoint's weights, from its config.json (None when it cannot be read)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
        return 4 * n_parameters(config)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def available_memory() -> int | None:
    """MemAvailable in bytes (None where /proc/meminfo is absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def free_disk(path: Path) -> int | None:
    """Free bytes on the file system that `path` (or its nearest existing parent) is on."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


@dataclass(frozen=True)
class Need:
    """What a request is estimated to need; `lighter`: the same request with a flag that needs less."""

    what: str
    memory: float
    disk: float
    lighter: tuple[str, float] | None = None  # (flag, memory with it)


def check_need(need: Need, out: Path) -> None:
    """Refuse now, in one sentence, when the estimate does not fit this machine's memory or disk."""
    mem, disk = available_memory(), free_disk(out)
    if mem is not None and need.memory > mem:
        hint = ""
        if need.lighter is not None:
            flag, lighter = need.lighter
            hint = f"; {flag} needs about {lighter / GB:.1f} GB" + (" (fits)" if lighter <= mem else "")
        raise ResourceError(
            f"{need.what} needs about {need.memory / GB:.1f} GB of memory (estimate) but {mem / GB:.1f} GB is "
            f"available; close other programs or use a machine with more memory{hint}."
        )
    if disk is not None and need.disk > disk:
        raise ResourceError(
            f"{need.what} writes about {need.disk / GB:.1f} GB but {disk / GB:.1f} GB is free on the disk of "
            f"{out} (it would run the disk full); free space or choose another output folder."
        )


def export_need(weight_bytes: int, validate: bool, external_threshold: int) -> Need:
    """gpt2edge export of a checkpoint with `weight_bytes` fp32 bytes."""
    w = float(weight_bytes)
    # a graph under 2 GB is written as external data, then streamed into one file: twice its size for a moment
    disk = w * (2.0 if w <= external_threshold else 1.0) + 0.05 * GB
    full = FIXED + (EXPORT if validate else EXPORT_NO_VALIDATE) * w
    lighter = ("--no-validate", FIXED + EXPORT_NO_VALIDATE * w) if validate else None
    return Need(f"Exporting this checkpoint ({w / GB:.1f} GB of fp32 weights)", full, disk, lighter)


# bytes of the variant per fp32 byte (the 8-bit head and scales included)
VARIANT_RATIO = {"fp16": 0.5, "int8": 0.3, "int4": 0.2}


def quantize_need(parent_bytes: int, mode: str, report: bool) -> Need:
    """gpt2edge quantize of an fp32 folder whose graph holds `parent_bytes`."""
    w = float(parent_bytes)
    out_bytes = VARIANT_RATIO[mode] * w
    # every mode streams (fp16 too: the converter sees no weights, each is rounded as it is written)
    full = FIXED + (QUANTIZE_REPORT if report else QUANTIZE_NO_REPORT) * w
    lighter = ("--no-report", FIXED + QUANTIZE_NO_REPORT * w) if report else None
    return Need(f"Quantizing this folder ({w / GB:.1f} GB of fp32 weights)", full, out_bytes + 0.05 * GB, lighter)


def checkpoint_need(weight_bytes: int) -> Need:
    w = float(weight_bytes)
    return Need(f"A random checkpoint of {w / GB:.1f} GB", FIXED + RANDOM_CHECKPOINT * w, w + 0.05 * GB)
