"""The graph's real head and KV-cache inputs against the manifest's: read wrongly, a mismatch is an IndexError
deep in scoring or an ONNX Runtime failure mid-decode."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gpt2edge.errors import ModelFolderError
from gpt2edge.manifest import KEEP_INPUT

if TYPE_CHECKING:
    import onnxruntime as ort

    from gpt2edge.runtime.model.folder import ModelFolder


def check_head(session: ort.InferenceSession, folder: ModelFolder) -> None:
    """The graph's real head: (batch, V) log-probs for last, (batch, seq, V) for all and tail, and a tail head
    takes the KEEP_INPUT input. A manifest whose head disagrees with its graph is refused here, not by an
    IndexError or an ONNX Runtime failure when the output is read."""
    rank = len(session.get_outputs()[0].shape)
    keeps = KEEP_INPUT in [i.name for i in session.get_inputs()]
    real = "last" if rank == 2 else "tail" if keeps else "all"
    if real != folder.head:
        raise ModelFolderError(
            f"{folder.path}: its manifest says head {folder.head!r} but the graph's head is {real!r} (log-probs of "
            f"rank {rank}); the manifest was edited or copied from another export: export the model again."
        )


def kept_ids(session: ort.InferenceSession, folder: ModelFolder) -> np.ndarray | None:
    """The folder's kept ids (gpt2edge trim-vocab), checked against the width of the graph's log-probs."""
    kept = folder.kept_ids()
    want = folder.dims.vocab_size if kept is None else len(kept)
    width = session.get_outputs()[0].shape[-1]
    if isinstance(width, int) and width != want:
        raise ModelFolderError(
            f"{folder.path}: the graph scores {width} tokens but its manifest describes {want}; "
            "export or trim the model again."
        )
    return kept


def check_cache_inputs(session: ort.InferenceSession, folder: ModelFolder, past_names: list[str]) -> None:
    """The graph's past inputs are the manifest's n_layer x (key, value) of (batch, n_head, past, head_dim) in its
    kv_dtype: a manifest edited or copied from another model is refused here, not by ONNX Runtime mid-decode."""
    d, kv = folder.dims, folder.graph.kv_dtype
    past = [i for i in session.get_inputs() if i.name in past_names]
    dtype = {"float32": "tensor(float)", "float16": "tensor(float16)", "int8": "tensor(int8)"}.get(kv)
    for i in past:
        dims = list(i.shape) if len(i.shape) == 4 else [None, -1, None, -1]
        fixed = [(g, w) for g, w in ((dims[1], d["n_head"]), (dims[3], d["head_dim"])) if isinstance(g, int)]
        if any(g != w for g, w in fixed) or (dtype is not None and i.type != dtype):
            raise ModelFolderError(
                f"{folder.path}: the graph's KV cache input {i.name} is {i.shape} {i.type}, but its manifest "
                f"says n_head {d['n_head']}, head_dim {d['head_dim']}, kv_dtype {kv}; export the model again."
            )
    if len(past) != 2 * d["n_layer"]:
        raise ModelFolderError(
            f"{folder.path}: the graph has {len(past)} KV cache inputs but its manifest says n_layer "
            f"{d['n_layer']} ({2 * d['n_layer']} inputs); export the model again."
        )
