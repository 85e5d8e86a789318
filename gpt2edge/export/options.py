"""The export options the CLI offers and the exporter checks. No torch here: `gpt2edge --help` and the
argument checks run before (and without) the heavy imports."""

from __future__ import annotations

import math

from gpt2edge.errors import ExportError

SUPPORTED_OPSETS = range(18, 24)  # the dynamo exporter starts at 18; 23 is the newest ONNX Runtime runs here
DEFAULT_OPSET = 18
DEFAULT_ATOL = 1e-4  # fp32 log-probs and presents vs PyTorch (README: "Parity thresholds")


def check_opset(opset: int) -> None:
    if opset not in SUPPORTED_OPSETS:
        raise ExportError(
            f"Opset {opset} is not supported; choose {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}."
        )


def check_atol(atol: float) -> None:
    """A validation tolerance must be a finite positive number: inf (or nan) would pass any graph."""
    if not (math.isfinite(atol) and atol > 0):
        raise ExportError(f"--atol must be a finite number > 0 (e.g. 1e-4), got {atol}.")
