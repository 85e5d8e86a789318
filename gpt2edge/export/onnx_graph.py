"""Trace an ExportableGPT2 to ONNX with Optimum-compatible IO names and dynamic batch / sequence axes."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from gpt2edge.errors import ExportError
from gpt2edge.export.fused_ops import onnx_translation
from gpt2edge.export.model import ExportableGPT2
from gpt2edge.export.options import DEFAULT_OPSET, check_opset
from gpt2edge.folder.checks import DISK_FULL, disk_full
from gpt2edge.manifest.records import KEEP_INPUT
from gpt2edge.onnx_io.stats import EXTERNAL_DATA_THRESHOLD


def io_names(n_layer: int, head: str = "last") -> tuple[list[str], list[str]]:
    """Graph input and output names, in order, as Optimum names them (a tail head's input comes last)."""
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    keep = [KEEP_INPUT] if head == "tail" else []
    return ["input_ids", "attention_mask", "position_ids", *past, *keep], ["logprobs", *present]


def io_spec(model: ExportableGPT2) -> dict[str, list[dict]]:
    """Names, dtypes and symbolic shapes of every input and output, for the manifest."""
    d = model.dims
    kv = ["batch", d.n_head, "past_seq", d.head_dim]  # shared: past_seq is the buffer's capacity
    # shared: present is the past buffer with the new slots written (bound to the same memory)
    present = [
        "batch",
        d.n_head,
        "past_seq + seq" if model.kv_cache == "concat" else "max(past_seq, total_seq)",
        d.head_dim,
    ]
    rows = {"last": [], "all": ["seq"], "tail": ["keep"]}[model.head]
    logprobs = ["batch", *rows, d.vocab_size]
    inputs, outputs = io_names(d.n_layer, model.head)
    past = [n for n in inputs[3:] if n != KEEP_INPUT]
    keep = [{"name": KEEP_INPUT, "dtype": "int64", "shape": ["keep"]}] if model.head == "tail" else []
    return {
        "inputs": [
            {"name": inputs[0], "dtype": "int64", "shape": ["batch", "seq"]},
            {"name": inputs[1], "dtype": "int64", "shape": ["batch", "past_seq + seq"]},
            {"name": inputs[2], "dtype": "int64", "shape": ["batch", "seq"]},
            *({"name": n, "dtype": "float32", "shape": kv} for n in past),
            *keep,
        ],
        "outputs": [
            {"name": outputs[0], "dtype": "float32", "shape": logprobs},
            *({"name": n, "dtype": "float32", "shape": present} for n in outputs[1:]),
        ],
    }


def _example_inputs(model: ExportableGPT2) -> tuple:
    # dynamo specialises sizes 0 and 1, so trace with batch 2, seq 3, past 2; the axes stay symbolic
    d = model.dims
    B, S, P = 2, 3, 2
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.ones(B, P + S, dtype=torch.long)
    pos = torch.arange(P, P + S).expand(B, S).contiguous()
    past = tuple(torch.zeros(B, d.n_head, P, d.head_dim) for _ in range(2 * d.n_layer))
    keep = (torch.tensor([1, 2]),) if model.head == "tail" else ()  # 2 of the 3 positions: keep stays symbolic
    return ids, mask, pos, *past, *keep


def export_graph(model: ExportableGPT2, path: Path, opset: int = DEFAULT_OPSET) -> list[str]:
    """Write the graph to `path`; returns the files written (the .onnx and, for big models, its data file)."""
    check_opset(opset)
    inputs, outputs = io_names(model.dims.n_layer, model.head)
    seq_axes = {0: "batch", 1: "seq"}
    past_axes = {0: "batch", 2: "past_seq"}
    # forward(ids, mask, positions, *past): the tail head's logits_to_keep is the last of *past
    rest = [{0: "keep"} if n == KEEP_INPUT else past_axes for n in inputs[3:]]
    dynamic_shapes = (seq_axes, {0: "batch", 1: "total_seq"}, seq_axes, tuple(rest))
    path = Path(path)
    try:
        # the exporter reports progress with print(); keep stdout clean for --json callers
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            # torch logs a warning per torchvision op it cannot register; irrelevant here
            logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
            # the shared-cache graph's custom ops become ONNX Runtime's fused nodes (fused_ops.py)
            translation = onnx_translation() if model.kv_cache == "shared" else None
            program = torch.onnx.export(
                model,
                _example_inputs(model),
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=dynamic_shapes,
                opset_version=opset,
                dynamo=True,
                custom_translation_table=translation,
                verbose=False,
            )
            # always external data first: the exporter then writes tensor by tensor (a single file would hold the
            # weights twice more, as a message and as its bytes); small graphs are made one file by inline_small
            program.save(str(path), external_data=True)
            _drop_weights(program)
    except ExportError:
        raise
    except OSError as e:
        if e.errno in DISK_FULL or disk_full(Path(path).parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e  # the caller's "Disk full" line
        raise ExportError(f"Tracing the model to ONNX failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    except Exception as e:  # the exporter raises many types; name the step that failed
        raise ExportError(f"Tracing the model to ONNX failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    return graph_files_of(path)


def _drop_weights(program) -> None:
    """Let go of the program's references to the torch weights: torch keeps parts of an exported program alive
    after export (its graph nodes stay referenced), and with them every parameter; dropping them here lets the
    caller free the model before ONNX Runtime loads the graph."""
    for value in program.model.graph.initializers.values():
        value.const_value = None
    exported = getattr(program, "exported_program", None)
    if exported is not None:
        exported.state_dict.clear()
        exported.constants.clear()


def graph_files_of(path: Path) -> list[str]:
    """The graph file and, when its weights are outside, every external data file it names."""
    from gpt2edge.onnx_io.stream import external_locations, load_graph

    return [path.name, *external_locations(load_graph(path))]


def inline_small(path: Path) -> list[str]:
    """Make a graph whose external data fits in one protobuf a single self-contained file, streamed tensor by
    tensor (no second copy of the weights); a larger one is left as it is. Returns the graph's files."""
    from gpt2edge.onnx_io.stream import external_locations, load_graph, passthrough, save_streaming

    path = Path(path)
    model = load_graph(path)
    locations = external_locations(model)
    data_bytes = sum((path.parent / f).stat().st_size for f in locations)
    if not locations or data_bytes > EXTERNAL_DATA_THRESHOLD:  # read at call time: tests lower it
        return [path.name, *locations]
    tmp = path.with_name(path.name + ".inline")
    save_streaming(model, tmp, passthrough(path.parent), external=False)
    os.replace(tmp, path)
    for f in locations:
        (path.parent / f).unlink()
    return [path.name]
