"""Score a text: log-likelihood and perplexity, with a sliding window when it is longer than the model.

The windows are those of transformers' perplexity guide (docs: "Perplexity of fixed-length models"): windows of
`max_length` tokens start every `stride` tokens, and each window scores only the tokens the previous window did
not, so every token is scored at most once, with at least `max_length - stride` tokens of context (except near
the start). A window's first token has no context inside it and is not scored: token 0 always, and with
non-overlapping windows (stride == max_length) the first token of every window, as in the guide. Per-token
negative log-likelihoods are summed exactly (the guide's loop weights each window's mean loss by one token fewer
than it scored after the first window; the sums here are the exact ones, so figures can differ from the guide's
in the 4th digit on long texts).

Two ways to get the log-probs of a window, chosen by the folder's graph:
  head-all:        a `--head all` export returns log-probs at every position: one forward per window.
  token-by-token:  a last-position export: the window's unscored context is prefilled in one forward, then each
                   scored token is fed through the KV cache and returns the log-probs of the next one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpt2edge.api_args import int_arg, text_arg
from gpt2edge.errors import ArgumentTypeError, GenerationError
from gpt2edge.runtime.model.columns import forward_columns, lm_columns
from gpt2edge.runtime.model.contract import LM
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.head_check import check_head
from gpt2edge.runtime.model.memory_plan import check_score_memory
from gpt2edge.runtime.model.ort_session import create_session, quiet_run_options, run_errors
from gpt2edge.runtime.model.tokenizer import TextTokenizer
from gpt2edge.runtime.open_model import load_graph

METHODS = ("auto", "head-all", "token-by-token")


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) go through the model; the log-probs of tokens [first_target, end) are kept."""

    begin: int
    end: int
    first_target: int


@dataclass
class ScoreResult:
    """What `Scorer.score` measured. token_logprobs[i] is log p(token i | its window's context), None where a token
    opens its window without context (token 0; see the module docstring)."""

    tokens: int
    scored_tokens: int
    log_likelihood: float  # sum of the scored tokens' natural-log probabilities
    mean_nll: float
    perplexity: float
    method: str
    max_length: int
    stride: int
    windows: int
    elapsed_ms: float
    token_ids: list[int] = field(repr=False)
    token_logprobs: list[float | None] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        """Scored tokens per second of model time (tokenization excluded)."""
        return self.scored_tokens / (self.elapsed_ms / 1e3) if self.elapsed_ms > 0 else 0.0

    def to_json(self, per_token: bool = True) -> dict:
        per_token_keys = ("token_ids", "token_logprobs")
        out = {k: getattr(self, k) for k in ScoreResult.__dataclass_fields__ if k not in per_token_keys}
        out["tokens_per_s"] = self.tokens_per_s
        if per_token:
            out["token_ids"] = self.token_ids
            out["token_logprobs"] = self.token_logprobs
        return out


def windows(n_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The guide's windows: begin every `stride` tokens, score what the previous window left unscored."""
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        # token `begin` has no context inside its window, so it is never a target (only token 0 ends up unscored)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return out


def check_plan(n_positions: int, max_length: int | None, stride: int | None) -> tuple[int, int]:
    """Resolve defaults (max_length = n_positions, stride = max_length // 2) and refuse plans that skip tokens."""
    max_length = n_positions if max_length is None else max_length
    if not 2 <= max_length <= n_positions:
        raise GenerationError(f"max_length must be in 2..{n_positions} (the model's positions), got {max_length}.")
    stride = max(1, max_length // 2) if stride is None else stride
    if not 1 <= stride <= max_length:
        raise GenerationError(
            f"stride must be in 1..max_length ({max_length}), got {stride}: a larger stride would skip tokens."
        )
    return max_length, stride


class Scorer:
    """Scores texts with one export folder. head-all graphs run a window in one forward; others token by token."""

    def __init__(self, folder: ModelFolder, device: str = "cpu", threads: int | None = None) -> None:
        if not isinstance(folder, ModelFolder):
            raise ArgumentTypeError(f"Scorer takes a ModelFolder (Scorer(ModelFolder.open(path))), got {folder!r:.60}.")
        self.folder = folder
        self.tokenizer = TextTokenizer(folder.tokenizer_path, folder.dims.vocab_size)
        self.vocab_size = int(folder.dims["vocab_size"])
        self.n_positions = int(folder.n_positions)  # a static-shape export: its cache capacity
        self.device, self.threads = device, threads
        self._lm: LM | None = None
        self._session = None

    @property
    def has_head_all(self) -> bool:
        return self.folder.head == "all"

    def encode(self, text: str) -> list[int]:
        """Tokens of the text; refuses an empty text and ids the model's vocabulary does not have."""
        # piece by piece: the ids, 4 bytes a token, not the tokenizer's ~300 while it encodes the whole text
        ids = self.tokenizer.encode_long(text_arg(text, "text"))
        if len(ids) < 2:
            raise GenerationError(
                f"The text has {len(ids)} token(s); scoring needs at least 2 (the first token has no context)."
            )
        top = max(ids)
        if top >= self.vocab_size:
            raise GenerationError(
                f"The tokenizer produced id {top} but the model has {self.vocab_size} tokens: the folder's "
                "tokenizer.json does not belong to its graph; re-export the model."
            )
        self._check_kept(ids[1:])  # token 0 is never scored
        return ids.tolist()

    def _check_kept(self, ids: Sequence[int]) -> None:
        """A vocabulary-trimmed head gives its dropped ids probability 0: a text using one has an infinite
        perplexity, which says nothing; refuse it and say which token, before any model work."""
        kept = self.folder.kept_ids()
        if kept is None:
            return
        keep = set(kept.tolist())
        dropped = [i for i in ids if i not in keep]
        if dropped:
            raise GenerationError(
                f"The text uses {len(dropped)} token(s) that {self.folder.path}'s vocabulary-trimmed head dropped "
                f"(first: {self.tokenizer.decode([dropped[0]])!r}, id {dropped[0]}), so its perplexity would be "
                "infinite; score with the untrimmed export it was trimmed from (manifest trim.parent)."
            )

    def score(
        self,
        text: str,
        max_length: int | None = None,
        stride: int | None = None,
        method: str = "auto",
        progress: Callable[[int, int], None] | None = None,
    ) -> ScoreResult:
        """progress(done, total): called after each window (a long text has thousands)."""
        text = text_arg(text, "text")  # a TypeError names a wrong type
        max_length, stride = int_arg(max_length, "max_length"), int_arg(stride, "stride")
        # real text runs 2-4 bytes a token: checked before the tokenizer holds them all
        check_score_memory(self.folder, len(text.encode("utf-8", "surrogatepass")) // 2, max_length)
        return self.score_ids(self.encode(text), max_length, stride, method, progress)

    def score_ids(
        self,
        ids: Sequence[int],
        max_length: int | None = None,
        stride: int | None = None,
        method: str = "auto",
        progress: Callable[[int, int], None] | None = None,
    ) -> ScoreResult:
        if method not in METHODS:
            raise GenerationError(f"Unknown scoring method '{method}'; choose one of {', '.join(METHODS)}.")
        if method == "auto":
            method = "head-all" if self.has_head_all else "token-by-token"
        if method == "head-all" and not self.has_head_all:
            raise GenerationError(
                f"{self.folder.path} returns log-probs at the last position only; export with --head all for "
                "one-pass scoring, or use --method token-by-token."
            )
        max_length, stride = int_arg(max_length, "max_length"), int_arg(stride, "stride")
        max_length, stride = check_plan(self.n_positions, max_length, stride)
        ids = [int(i) for i in ids]
        self._check_kept(ids[1:])
        plan = windows(len(ids), max_length, stride)
        window_fn = self._window_head_all if method == "head-all" else self._window_token_by_token
        logprobs: list[float | None] = [None] * len(ids)
        t0 = time.perf_counter()
        for k, w in enumerate(plan, 1):
            logprobs[w.first_target : w.end] = window_fn(ids, w)
            if progress is not None:
                progress(k, len(plan))
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        scored = np.array([x for x in logprobs if x is not None], dtype=np.float64)
        ll = float(scored.sum())
        mean_nll = -ll / len(scored)
        return ScoreResult(
            tokens=len(ids),
            scored_tokens=len(scored),
            log_likelihood=ll,
            mean_nll=mean_nll,
            perplexity=float(np.exp(mean_nll)),
            method=method,
            max_length=max_length,
            stride=stride,
            windows=len(plan),
            elapsed_ms=elapsed_ms,
            token_ids=ids,
            token_logprobs=logprobs,
        )

    def _window_head_all(self, ids: list[int], w: Window) -> list[float]:
        """One forward of the whole window with an empty past; row j of the output predicts token begin+j+1."""
        if self._session is None:
            session = create_session(
                self.folder.graph_path, device=self.device, threads=self.threads, kleidiai=self.folder.kleidiai
            )
            check_head(session, self.folder)  # a manifest claiming head all over a last-head graph
            self._session = session
        T = w.end - w.begin
        feed = {
            "input_ids": np.asarray([ids[w.begin : w.end]], dtype=np.int64),  # (1, T)
            "attention_mask": np.ones((1, T), dtype=np.int64),
            "position_ids": np.arange(T, dtype=np.int64)[None],
        }
        d = self.folder.dims
        # concat graphs take an empty past; shared graphs take a buffer with room for the window
        past_len = T if self.folder.kv_cache == "shared" else 0
        empty = np.zeros((1, d["n_head"], past_len, d["head_dim"]), dtype=self.folder.kv_dtype)
        for inp in self._session.get_inputs()[3:]:
            feed[inp.name] = empty
        with run_errors(self.folder.graph_path):
            lp = self._session.run(["logprobs"], feed, quiet_run_options())[0][0]  # (T, V)
        rows = np.arange(w.first_target - 1, w.end - 1) - w.begin
        return [float(x) for x in lp[rows, ids[w.first_target : w.end]]]

    def _window_token_by_token(self, ids: list[int], w: Window) -> list[float]:
        """Prefill the window's context up to its first target, then feed each target through the cache."""
        if self._lm is None:
            # OrtLM, or StaticLM on a static-shape export
            self._lm = load_graph(self.folder, device=self.device, threads=self.threads).new_lm()
        lm = self._lm
        columns = lm_columns(lm)  # a trimmed head: read each target's own column (_check_kept: all are kept)
        col = (lambda i: i) if columns is None else (lambda i: int(columns.col[i]))
        lm.start(1, w.end - w.begin)
        ctx = ids[w.begin : w.first_target]  # (n_ctx,) tokens whose next-token log-probs are not needed
        n_ctx = len(ctx)
        mask = np.ones((1, w.end - w.begin), dtype=np.int64)
        lp = forward_columns(lm, np.asarray([ctx], np.int64), mask[:, :n_ctx], np.arange(n_ctx, dtype=np.int64)[None])
        out = []
        for t in range(w.first_target, w.end):
            out.append(float(lp[0, col(ids[t])]))
            if t + 1 == w.end:
                break
            pos = t - w.begin
            lp = forward_columns(lm, np.array([[ids[t]]], np.int64), mask[:, : pos + 1], np.array([[pos]], np.int64))
        return out
