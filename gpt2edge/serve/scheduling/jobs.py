"""Typed records passed between the HTTP layer and the scheduler thread: jobs, their rows, and what comes back."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpt2edge.runtime.decoding.row_decoder import RowDecoder
from gpt2edge.runtime.model.tokenizer import TextStream, TextTokenizer
from gpt2edge.serve.scheduling.logprobs import ChoiceLogprobs, TokenEntry

_ids = itertools.count(1)


@dataclass(frozen=True)
class Sampling:
    """A request's sampling knobs. temperature 0 is greedy. OpenAI's own; vLLM's and llama-server's extras
    (top_k, min_p, typical_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos) with their off values.

    They map onto the runtime's SamplingParams (generate_kwargs): the scheduler's RowDecoder applies them per
    row (runtime/decoding/row_decoder.py), so every scheduler takes every field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float | None = None
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    constraint: Any = None  # structured output: a runtime Constraint (frozen, compared by kind and text)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generate_kwargs(self) -> dict[str, Any]:
        """Generator.generate keywords: OpenAI semantics, not the folder's generation_config.json (its beams,
        n-gram and bad-word bans... are skipped: transformers' defaults, which are off, apply), and top-k off
        unless asked (transformers' default is 50). One sequence per row: OpenAI's n is rows of the batch."""
        common = dict(folder_defaults=False, ignore_eos=self.ignore_eos, top_k=self.top_k,
                      repetition_penalty=self.repetition_penalty, min_new_tokens=self.min_tokens,
                      presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                      logit_bias=self.logit_bias, stop_token_ids=self.stop_token_ids)  # fmt: skip
        if self.greedy:
            return dict(common, do_sample=False)
        return dict(common, do_sample=True, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                    min_p=self.min_p, typical_p=self.typical_p)  # fmt: skip


@dataclass(frozen=True)
class Piece:
    """New text of one choice; finish_reason is set on the choice's last piece ("stop" or "length").
    logprobs: the tokens that start in this text, when the request asked for logprobs."""

    choice: int
    text: str
    finish_reason: str | None
    completion_tokens: int
    logprobs: list[TokenEntry] | None = None


@dataclass(frozen=True)
class Failure:
    """The job cannot finish (a numerical failure while decoding, the server shutting down, a slow reader)."""

    message: str
    code: str = "generation_failed"


Event = Piece | Failure


@dataclass
class Row:
    """One choice of one job: a batch row."""

    job: Job
    choice: int
    prompt: str
    prompt_len: int
    text: TextStream  # its text and stop strings (the runtime's one stop matcher)
    logprobs: ChoiceLogprobs | None = None  # when the request asked for them
    decoder: RowDecoder | None = None  # the runtime's row (its finish rule), set by the scheduler that runs it
    n_tokens: int = 0
    sent: int = 0  # characters of text emitted so far
    done: bool = False
    dropped: bool = False  # its client left before it finished: decoding it stopped mattering
    last_token_at: float = 0.0  # time.monotonic() of its latest token (inter-token latency)


@dataclass
class Job:
    """One request: every prompt times n choices, all with the same sampling, max_tokens and stop strings.

    emit() is called from the scheduler thread; the HTTP layer passes a function that hands the event to its
    event loop. cancel() may be called from any thread (a client that went away).
    """

    prompts: Sequence[str]
    prompt_lens: Sequence[int]
    n: int
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    emit: Callable[[Event], None]
    tokenizer: TextTokenizer
    logprobs: int | None = None  # OpenAI's logprobs: report each token's log-prob and its top N
    prompt_ids: Sequence[Sequence[int]] | None = None  # each prompt's token ids, when already encoded
    metrics: Any = None  # serve.api.metrics.Metrics: told of every token (time to first token, inter-token latency)
    request_id: str = ""  # the HTTP request's id, for log lines about this job
    constraint: Any = None  # the sampling's constraint compiled for this model (runtime CompiledConstraint)
    id: int = field(default_factory=lambda: next(_ids))
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = field(default=None, init=False)
    cached_tokens: int = field(default=0, init=False)  # prompt tokens the prefix cache supplied (set at join)
    rows: list[Row] = field(init=False)
    _cancelled: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self) -> None:
        # choice index = prompt index * n + j, as OpenAI numbers them
        self.rows = [
            Row(self, p * self.n + j, prompt, plen, self._text(), self._choice_logprobs(prompt))
            for p, (prompt, plen) in enumerate(zip(self.prompts, self.prompt_lens))
            for j in range(self.n)
        ]

    def _text(self) -> TextStream:
        return TextStream(self.tokenizer, self.stop)

    def _choice_logprobs(self, prompt: str) -> ChoiceLogprobs | None:
        return None if self.logprobs is None else ChoiceLogprobs(self.tokenizer, self.logprobs, len(prompt))

    @property
    def key(self) -> tuple:
        """Jobs with equal keys can share a batch (one SamplingParams per batch). A seeded sampled job runs
        alone, so the same seed gives the same text whoever else is being served."""
        s = self.sampling
        if s.greedy or s.seed is None:
            return ("same", s if not s.greedy else replace(s, top_p=1.0, seed=None, min_p=None, typical_p=1.0))
        return ("seeded", self.id)

    @property
    def max_prompt_len(self) -> int:
        return max(self.prompt_lens)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def finished(self) -> bool:
        return all(r.done for r in self.rows)
