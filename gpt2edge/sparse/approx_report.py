"""The approximate head's quality report, written when the folder is made (like quantize's).

The held-out text runs through the body graph once, window after window of n_positions tokens (a window's last
position predicts the next window's first token from its own context). The parent's full head and the
approximate head score the same hidden states, so the figures measure the head alone: mean and max
KL(full || approximate), top-1 agreement, max |delta log-prob|, perplexity of each on the text
(gpt2edge.quality.stream_metrics), greedy agreement from several points of the text (the parent folder against
the approximate one), and the rows read per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from gpt2edge.quality import greedy_continuation, greedy_fields, greedy_plan, stream_metrics
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.tokenizer import TextTokenizer
from gpt2edge.runtime.open_model import load_graph

CHUNK = 256  # hidden states per head run


def hidden_states(body, tokens: list[int], n_positions: int) -> np.ndarray:
    """(T, C) the head's input at every position of the text, in windows of n_positions tokens."""
    lm = body.new_lm()
    out = []
    for lo in range(0, len(tokens), n_positions):
        win = tokens[lo : lo + n_positions]
        lm.start(1, len(win))
        mask = np.ones((1, len(win)), dtype=np.int64)
        for t, tok in enumerate(win):
            h = lm.forward(np.array([[tok]], np.int64), mask[:, : t + 1], np.array([[t]], np.int64))
            out.append(np.array(h[0], dtype=np.float32))  # copy: the bound buffer is reused
    return np.stack(out)


def cluster_report(folder: Path, parent: Path, head: onnx.ModelProto, tokens: list[int]) -> dict[str, Any]:
    """The report on the approximate folder `folder` (being made) against its parent's full head `head`."""
    import onnxruntime as ort

    apx = load_graph(ModelFolder.open(folder, verify=False))
    n_pos = apx.n_positions
    H = hidden_states(apx.body, tokens, n_pos)
    full = ort.InferenceSession(head.SerializeToString(), providers=["CPUExecutionProvider"])
    lp_full = np.concatenate([full.run(None, {"hidden": H[i : i + CHUNK]})[0] for i in range(0, len(H), CHUNK)])
    lp_apx = np.concatenate([apx.head(H[i : i + CHUNK]) for i in range(0, len(H), CHUNK)])
    report = stream_metrics(lp_full, lp_apx, tokens)
    del lp_full, lp_apx

    # greedy decoding from several points of the text: the parent's folder against the approximate one
    pfolder = ModelFolder.open(parent, verify=False)
    tokenizer = TextTokenizer(pfolder.tokenizer_path, pfolder.dims.vocab_size)
    first = tokens[:n_pos]
    starts, n_new = greedy_plan(len(first), n_pos)
    ref_lm, apx_lm = load_graph(pfolder).new_lm(), apx.new_lm()
    ref = [greedy_continuation(ref_lm, tokenizer, first[:s], n_new) for s in starts]
    var = [greedy_continuation(apx_lm, tokenizer, first[:s], n_new) for s in starts]
    report.update(greedy_fields(ref, var, starts))
    rec = apx.rec
    V = apx.vocab_size
    report.update(
        reference=f"the full head of {parent}",
        variant=str(folder),
        rows_read_per_step=rec.rows_per_step,
        rows_read_fraction=rec.rows_per_step / V,
        centroids_per_step=rec.clusters,
    )
    return report
