"""The approximate sparse head (`gpt2edge sparse-head --mode cluster`): not the model's distribution.

The body graph (an OrtGraph returning `hidden`) runs the blocks; approx.onnx turns each hidden state into a
log-prob row of the approximate distribution: the M best of K cluster centroids are probed, their tokens get
exact logits, every other token its cluster's mean logit (gpt2edge.sparse.approx_graph). Generation (generate,
stream, batches, sessions, serve) samples from those rows with any sampler. Everything that would present them
as the model's own log-probs or scores is refused with one line: logprobs=N, beam search and several sequences
per prompt, scoring, parity, speculative decoding. A result says it came from an approximate head
(GenerationResult.head), and so does the manifest (`sparse_head.approximate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.manifest import resolve_inside
from gpt2edge.manifest.records import Manifest, check_relpath
from gpt2edge.runtime.model.ort_session import create_session, quiet_run_options, run_errors
from gpt2edge.runtime.sparse_head.body import BodyGraph, BodyLM

APPROX_FILE = "approx.onnx"
MODES = ("cluster",)
MAX_CLUSTERS = 4096
FIX = "build it again with `gpt2edge sparse-head --mode cluster`"


@dataclass(frozen=True)
class ApproxHeadInfo:
    """The manifest's `sparse_head` record of an approximate folder."""

    mode: str
    head_file: str
    clusters: int
    probe: int
    cluster_size: int
    kind: str

    @property
    def rows_per_step(self) -> int:
        return self.probe * self.cluster_size

    @classmethod
    def of(cls, info: Manifest, where: str) -> ApproxHeadInfo:
        rec = info.raw.get("sparse_head")
        if not isinstance(rec, dict) or rec.get("mode") not in MODES or rec.get("approximate") is not True:
            raise ModelFolderError(f"{where}: 'sparse_head' is not an approximate head's record; {FIX}.")
        head = check_relpath(rec.get("head_file"), where, "sparse_head.head_file")
        if head not in info.files:
            raise ModelFolderError(f"{where}: {head} is loaded but not listed in 'files'; {FIX}.")
        k, m, s = (rec.get(f) for f in ("clusters", "probe", "cluster_size"))
        V = info.dims.vocab_size
        ints = all(type(x) is int for x in (k, m, s))
        if not ints or not (2 <= k <= MAX_CLUSTERS and 1 <= m <= k and s >= 1 and (s - 1) * k < V <= s * k):
            raise ModelFolderError(
                f"{where}: sparse_head clusters {k!r} / probe {m!r} / cluster_size {s!r} do not fit a "
                f"{V}-token vocabulary; {FIX}."
            )
        return cls(rec["mode"], head, k, m, s, str(rec.get("kind")))

    def describe(self) -> dict[str, Any]:
        """What a result and a log line say about the head that made it."""
        return {
            "approximate": True,
            "mode": self.mode,
            "clusters": self.clusters,
            "probe": self.probe,
            "rows_per_step": self.rows_per_step,
        }


def refusal(what: str) -> str:
    return (
        f"{what} is not served by an approximate LM head (sparse-head --mode cluster), whose rows are not the "
        "model's log-probs; use its parent folder (manifest sparse_head.parent) for it."
    )


class ApproxGraph(BodyGraph):
    """An approximate sparse-head folder loaded once (shared by threads): the body graph and approx.onnx."""

    def __init__(self, body, device: str = "cpu", threads: int | None = None, spin: bool = True) -> None:
        folder = body.folder
        self._take_body(body)
        self.device = device
        self.rec = ApproxHeadInfo.of(folder.info, str(folder.path / "manifest.json"))
        self.head_path = resolve_inside(folder.path, self.rec.head_file)
        self.head_session = create_session(
            self.head_path, device=device, threads=threads, spin=spin, kleidiai=folder.kleidiai
        )
        self.run_options = quiet_run_options()
        d = folder.dims
        ins, outs = self.head_session.get_inputs(), self.head_session.get_outputs()
        width, vocab = ins[0].shape[-1] if ins else None, outs[0].shape[-1] if outs else None
        if [i.name for i in ins] != ["hidden"] or width != d.n_embd or vocab != d.vocab_size:
            raise ModelFolderError(
                f"{self.head_path} is not an approximate head for this model (hidden {d.n_embd} -> "
                f"{d.vocab_size} log-probs); {FIX}."
            )

    # why gpt2edge.runtime.model.slots does not serve it (the server then runs next-batch, where ApproxLM refuses
    # what its head cannot do): rows that join and leave would not apply those refusals (logprobs)
    own_slot_refusal = "an approximate sparse head (--mode cluster) is served one batch at a time, under its refusals"

    def slot_view(self):
        raise GenerationError(f"Cache rows that join and leave cannot run this folder: {self.own_slot_refusal}.")

    @property
    def approximate(self) -> dict[str, Any]:
        return self.rec.describe()

    def new_lm(self, io_binding: bool = True) -> ApproxLM:
        return ApproxLM(self, io_binding=io_binding)

    def head(self, h: np.ndarray) -> np.ndarray:
        """(B, C) hidden -> (B, V) float32 log-probs of the approximate distribution."""
        with run_errors(self.head_path):
            x = {"hidden": np.ascontiguousarray(h, dtype=np.float32)}
            return self.head_session.run(None, x, self.run_options)[0]


class ApproxLM(BodyLM):
    """OrtLM's contract on an approximate folder: forward() -> (B, V) approximate log-probs, once a generate
    loop has called configure_head(params, logprobs) after start(). A loop that never configures the head
    (beam search, several sequences per prompt, scoring, parity) is refused at its first forward, before any
    output. Not thread-safe (one per generation, like OrtLM)."""

    def __init__(self, graph: ApproxGraph, io_binding: bool = True) -> None:
        super().__init__(graph, io_binding)
        self.configured = False

    def start(self, batch: int, length: int) -> None:
        self.configured = False  # each generation configures again
        self.body.start(batch, length)

    def configure_head(self, params, logprobs: bool = False) -> dict[str, Any]:
        """A generate loop's call: sampling from the approximate rows is what this folder is for; recording
        log-probs is not. Returns the head's description for the result."""
        if logprobs:
            raise GenerationError(refusal("Recording logprobs"))
        self.configured = True
        return self.graph.approximate

    def forward(self, input_ids, attention_mask, position_ids, keep: int | None = None) -> np.ndarray:
        if not self.configured:
            raise GenerationError(refusal("Beam search, several sequences per prompt, scoring or a parity report"))
        h = self.body.forward(input_ids, attention_mask, position_ids, keep)
        if keep is not None:  # a last-position graph: keep is 1 (OrtLM refuses more)
            return self.graph.head(h[:, -1])[:, None]
        return self.graph.head(h)
