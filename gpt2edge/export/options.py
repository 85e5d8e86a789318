"""The export options the CLI offers and the exporter checks. No torch here: `gpt2edge --help` and the
argument checks run before (and without) the heavy imports."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gpt2edge.errors import ExportError

SUPPORTED_OPSETS = range(18, 24)  # the dynamo exporter starts at 18; 23 is the newest ONNX Runtime runs here
DEFAULT_OPSET = 18
DEFAULT_ATOL = 1e-4  # fp32 log-probs and presents vs PyTorch (docs/parity.md)


def check_opset(opset: int) -> None:
    if opset not in SUPPORTED_OPSETS:
        raise ExportError(
            f"Opset {opset} is not supported; choose {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}."
        )


def check_atol(atol: float) -> None:
    """A validation tolerance must be a finite positive number: inf (or nan) would pass any graph."""
    if not (math.isfinite(atol) and atol > 0):
        raise ExportError(f"--atol must be a finite number > 0 (e.g. 1e-4), got {atol}.")


_STATIC_SPEC = re.compile(r"^(\d+)x(\d+)x(\d+)$")


@dataclass(frozen=True)
class StaticShape:
    """`--static BATCHxCHUNKxCAPACITY`: rows per call, tokens per prefill call, KV cache slots."""

    batch: int
    chunk: int
    capacity: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.chunk}x{self.capacity}"


def parse_static_spec(spec: str) -> StaticShape:
    """'1x64x1024' -> StaticShape(1, 64, 1024); the model's own limit is checked by check_static_capacity."""
    m = _STATIC_SPEC.match(str(spec).strip().lower())
    if not m:
        raise ExportError(f"--static wants BATCHxCHUNKxCAPACITY (e.g. 1x64x1024), got '{spec}'.")
    shape = StaticShape(*(int(g) for g in m.groups()))
    if min(shape.batch, shape.chunk) < 1 or shape.capacity < 2:
        raise ExportError(
            f"--static {spec}: batch and chunk must be >= 1 and capacity >= 2 (a prompt token and the next one)."
        )
    if shape.chunk > shape.capacity:
        raise ExportError(f"--static {spec}: the chunk ({shape.chunk}) cannot exceed the capacity ({shape.capacity}).")
    return shape


def check_static_capacity(shape: StaticShape, n_positions: int) -> None:
    """The cache cannot hold more positions than the model has position embeddings."""
    if shape.capacity > n_positions:
        raise ExportError(
            f"--static {shape}: capacity {shape.capacity} exceeds the model's {n_positions} positions; "
            f"use at most {n_positions}."
        )


KV_DTYPE_CHOICES = ("fp32", "fp16", "int8")  # --kv-dtype of export and quantize (gpt2edge.quantize.kv.KV_DTYPES)


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise ExportError(f"Unknown --kv-dtype '{kv_dtype}'; choose one of {', '.join(KV_DTYPE_CHOICES)}.")


def check_static_options(head: str, kv_cache: str, kv_dtype: str = "fp32") -> None:
    """A static graph is its own cache layout with a last-position head: refuse what does not combine."""
    if head != "last":
        raise ExportError("--static exports a generation graph; --head all (scoring) cannot be combined with it.")
    if kv_cache != "concat":
        raise ExportError(
            f"--static has its own fixed-capacity cache; --kv-cache {kv_cache} cannot be combined with it."
        )
    if kv_dtype != "fp32":
        raise ExportError(
            f"--static has its own fixed-capacity float32 cache; --kv-dtype {kv_dtype} cannot be combined with it "
            "(export without --static for a compact cache)."
        )
