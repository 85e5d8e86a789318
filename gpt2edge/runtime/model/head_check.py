"""The graph's real head against the manifest's: read wrongly, a mismatch is an IndexError deep in scoring."""

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
