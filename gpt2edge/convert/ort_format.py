"""ONNX -> ORT format: the FlatBuffer graph that minimal and mobile ONNX Runtime builds load, made by ONNX
Runtime's own converter (onnxruntime.tools.convert_onnx_models_to_ort), plus the operator list that a minimal
build is compiled with (`build.sh --minimal_build --include_ops_by_config required_operators.config`).

Optimization style "Fixed": every graph optimization (ONNX Runtime level "all", minus the x86-only NCHWc
layout) is applied now and saved into the file, so a minimal build, which has no optimizers, runs the
optimized graph as it is. ("Runtime" saves optimizations to replay at load, for NNAPI/CoreML partitioning; the
CPU execution provider gains nothing from it.)
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from gpt2edge.errors import ConvertError
from gpt2edge.folder.checks import disk_full

CONFIG_NAME = "required_operators.config"
OPTIMIZATION_STYLE = "Fixed"
# the converter reads its optimization level from this variable (default "all"); recorded in the manifest
LEVEL_VARIABLE = "ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL"
# an ORT format file is one FlatBuffer, which cannot exceed 2 GiB (no external data)
MAX_ORT_BYTES = 2**31 - 2**26


@dataclass
class OrtConversion:
    file: str  # the .ort graph, relative to the folder
    required_operators: str  # the minimal build's operator config, relative to the folder
    optimization_style: str
    optimization_level: str
    onnxruntime: str  # version that wrote the file: a build of at least this version loads it

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def check_ort_size(graph_bytes: int, src: Path) -> None:
    """Refuse a graph too large for one FlatBuffer before any work starts."""
    if graph_bytes > MAX_ORT_BYTES:
        raise ConvertError(
            f"{src} holds a {graph_bytes / 1e9:.1f} GB graph; ORT format keeps the whole graph in one file under "
            "2 GB. Quantize it first (`gpt2edge quantize --mode int8` or int4) and convert the result."
        )


def convert_to_ort(onnx_path: Path, out_dir: Path) -> OrtConversion:
    """Write `<stem>.ort` and required_operators.config for the graph at onnx_path into out_dir."""
    import onnxruntime as ort
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    onnx_path, out_dir = Path(onnx_path), Path(out_dir)
    level = os.environ.get(LEVEL_VARIABLE, "all")
    # the converter prints progress on stdout (kept off it: --json callers), logs the temporary config path at
    # INFO, and names its files after the level: it writes into a scratch folder, quietly
    with (
        tempfile.TemporaryDirectory(dir=out_dir, prefix=".ort-") as work,
        contextlib.redirect_stdout(io.StringIO()),
        _quiet("ort_format_model.utils"),
    ):
        try:
            convert_onnx_models_to_ort(
                onnx_path, output_dir=Path(work), optimization_styles=[OptimizationStyle[OPTIMIZATION_STYLE]]
            )
        except Exception as e:  # ONNX Runtime raises its own exception types (Fail, InvalidGraph, ...)
            if disk_full(out_dir):  # ORT's "Failed to save ORT format model" does not say why: the folder says
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out_dir)) from e  # "Disk full" line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConvertError(f"ONNX Runtime could not convert {onnx_path} to ORT format: {first}") from e
        graphs = sorted(Path(work).glob("*.ort"))
        configs = sorted(Path(work).glob("*.config"))
        if len(graphs) != 1 or len(configs) != 1:
            raise ConvertError(f"ONNX Runtime's converter wrote {len(graphs)} .ort and {len(configs)} .config files.")
        name = onnx_path.stem + ".ort"
        shutil.move(graphs[0], out_dir / name)
        (out_dir / CONFIG_NAME).write_text(_relative_config(configs[0].read_text(), name))
    return OrtConversion(name, CONFIG_NAME, OPTIMIZATION_STYLE, level, ort.__version__)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Raise a logger to WARNING for the duration, then restore its level."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _relative_config(text: str, name: str) -> str:
    """The config's header names the model by its absolute (temporary) path; name it by its file name."""
    lines = ["# - " + name if line.startswith("# - ") else line for line in text.splitlines()]
    return "\n".join(lines) + "\n"


def required_operators(config: Path) -> dict[str, list[str]]:
    """`domain;opset` -> operator names, as listed in a required_operators.config."""
    ops: dict[str, list[str]] = {}
    for line in Path(config).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            domain, opset, names = line.split(";", 2)
            ops[f"{domain};{opset}"] = names.split(",")
    return ops
