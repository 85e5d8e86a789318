"""A conversation that keeps its KV cache across calls (llama.cpp's `-i`/`--interactive`, transformers' reuse of
`past_key_values`): `session = Generator(dir).session(); session.append("..."); session.generate(...)`.

The session owns one OrtLM, reserved once for n_positions, and the token history of everything appended and
generated. Invariant between turns: the cache holds every history token but perhaps the last (the last token a
turn samples is never fed by that turn). So a turn feeds, in one forward, only what the cache lacks: the
previous turn's last token and the text appended since; its prefill cost does not grow with the history.

append() only tokenizes: the tokens are fed by the next turn, which knows its max_new_tokens and so whether the
context still fits. When it would not (history + max_new_tokens > n_positions), the oldest tokens are dropped,
keeping the newest half of the positions (or fewer when max_new_tokens needs more room), as llama.cpp's
context shift does, so that later turns do not overflow again at once; GPT-2's positions are absolute, so the
kept tokens are prefilled again from position 0. Each overflow is reported to `on_overflow`, or else as a
ContextOverflowWarning.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gpt2edge.api_args import text_arg
from gpt2edge.errors import GenerationError
from gpt2edge.runtime.constraints import compile_for
from gpt2edge.runtime.decoding.beam import check_one_sequence
from gpt2edge.runtime.decoding.generate import GenerationState, Step, configure_head, decode_n_tokens
from gpt2edge.runtime.decoding.logprobs import LogprobRecorder
from gpt2edge.runtime.decoding.prefix_fill import load_prefix, remember, usable
from gpt2edge.runtime.decoding.sampling_params import SamplingParams
from gpt2edge.runtime.model.columns import forward_columns
from gpt2edge.runtime.model.contract import LM
from gpt2edge.runtime.model.tokenizer import TextStream, TextTokenizer
from gpt2edge.runtime.results import GenerationResult, results_of
from gpt2edge.runtime.session_file import read_session, save_session


class GeneratorLike(Protocol):
    """What a Conversation uses of its gpt2edge.runtime.generator.Generator (a protocol, so that this module
    does not import the one that creates it: generator -> conversation, never back)."""

    tokenizer: TextTokenizer
    defaults: dict[str, Any]
    bos_token_id: int
    pad_token_id: int

    def sampling_params(self, **kwargs: Any) -> SamplingParams: ...

    def logprob_recorder(self, n: int | None, batch: int) -> LogprobRecorder | None: ...


class ContextOverflowWarning(UserWarning):
    """A session's context passed n_positions and its oldest tokens were dropped."""


@dataclass(frozen=True)
class ContextOverflow:
    """The oldest `dropped` tokens left the context; the newest `kept` ones were prefilled again."""

    dropped: int
    kept: int
    n_positions: int

    def message(self) -> str:
        return (
            f"context full ({self.n_positions} positions): dropped the oldest {self.dropped} tokens, "
            f"re-prefilling the newest {self.kept}"
        )


def kept_length(history: int, max_new_tokens: int, n_positions: int) -> int | None:
    """How many of the newest history tokens a turn keeps, or None when all of them fit."""
    room = n_positions - max_new_tokens  # context tokens that fit with this turn's output
    if history <= room:
        return None
    return min(room, n_positions // 2)  # drop at least half the positions, so the next turns fit again


class Conversation:
    """Turns on one KV cache: append() text, generate() or stream() a continuation; both extend the history.

    One thread at a time (it owns one OrtLM); other calls of its Generator run alongside on their own caches.
    Sampling arguments are those of Generator.generate. Not usable while one of its streams is still open.
    """

    def __init__(
        self, generator: GeneratorLike, lm: LM, on_overflow: Callable[[ContextOverflow], None] | None = None
    ) -> None:
        self.generator = generator
        self.lm = lm
        self.n_positions = lm.n_positions
        self.on_overflow = on_overflow
        self._history: list[int] = []
        self._mask = np.ones((1, self.n_positions), dtype=np.int64)  # batch 1, no padding: every position is real
        self._cache_valid = False  # False: rebuild the cache from the history before the next turn
        self._turn = threading.Lock()  # held by the thread running a turn
        self._owner: int | None = None  # that thread's id
        self.last_prefill_tokens = 0  # tokens the last turn fed in its prefill (what the cache lacked)
        lm.start(1, self.n_positions)  # the one reservation for the whole conversation

    @property
    def token_ids(self) -> list[int]:
        """The context: every token appended or generated and not dropped since."""
        return list(self._history)

    @property
    def text(self) -> str:
        return self.generator.tokenizer.decode(self._history)

    def append(self, text: str) -> list[int]:
        """Add text to the context (tokenized on its own, as typed); the next turn feeds it. Returns its ids."""
        self._check_idle()
        ids = self.generator.tokenizer.encode(text_arg(text, "text"))
        self._history += ids
        return ids

    def reset(self) -> None:
        """Forget the context (the cache memory is kept)."""
        self._check_idle()
        self._history = []
        self._cache_valid = False

    def save(self, path: str | os.PathLike) -> Path:
        """Write the context and its KV cache to `path` (atomically; gpt2edge.runtime.session_file). A session
        loaded from it continues with exactly the tokens this one would. Raises SessionFileError."""
        with self._idle():
            cached = self.lm.past_len if self._cache_valid else 0  # an invalid cache is rebuilt after load, as here
            return save_session(path, self.lm, self._history, cached)

    def load(self, path: str | os.PathLike) -> None:
        """Replace the context and cache with a file save() wrote from this folder; every check runs before
        anything changes, so a refused file (SessionFileError, one line) leaves the session as it was."""
        with self._idle():  # no turn may start while the cache is read or replaced
            saved = read_session(path, self.lm)
            self.lm.start(1, self.n_positions)  # the same reservation; past_len = 0
            if saved.cached:
                self.lm.load_row(saved.tensors)
            self._history = saved.tokens
            self._cache_valid = saved.cached > 0

    def generate(
        self,
        prompt: str | None = None,
        *,
        callback: Callable[[Step], None] | None = None,
        ignore_eos: bool = False,
        stop: str | Sequence[str] | None = (),
        seed: int | None = None,
        logprobs: int | None = None,
        **sampling: Any,
    ) -> GenerationResult:
        """Append `prompt` (if given), then continue the context. Its prompt_token_ids are the whole context the
        model saw; its prefill_ms times the one forward of this turn's new tokens. Ctrl-C ends the turn with
        finish_reason "interrupted" and keeps what it generated."""
        prompt = None if prompt is None else text_arg(prompt, "prompt")
        state = self._prepare(ignore_eos, stop, seed, logprobs, sampling)
        with closing(self._steps(prompt, state)) as steps:
            try:
                for step in steps:
                    if callback is not None:
                        callback(step)
            except KeyboardInterrupt:
                state.finish_reasons = [r or "interrupted" for r in state.finish_reasons]
        return results_of(state)[0]

    def stream(
        self,
        prompt: str | None = None,
        *,
        ignore_eos: bool = False,
        stop: str | Sequence[str] | None = (),
        seed: int | None = None,
        result: list | None = None,
        logprobs: int | None = None,
        **sampling: Any,
    ) -> Iterator[str]:
        """generate() as text pieces (see Generator.stream); bad parameters raise here. The turn starts at the
        first piece; closing the stream early ends it there, keeping the tokens generated so far."""
        prompt = None if prompt is None else text_arg(prompt, "prompt")
        state = self._prepare(ignore_eos, stop, seed, logprobs, sampling)
        return self._pieces(prompt, state, result)

    def _pieces(self, prompt: str | None, state: GenerationState, result: list | None) -> Iterator[str]:
        text = None
        with closing(self._steps(prompt, state)) as steps:
            for _ in steps:
                text = state.texts[0]
                piece = text.take()
                if piece:
                    yield piece
        if text is not None:
            text.finish()
            tail = text.take()
            if tail:
                yield tail
        if result is not None:
            result.append(results_of(state)[0])

    def _prepare(self, ignore_eos, stop, seed, logprobs, sampling) -> GenerationState:
        """Check the turn's parameters before anything changes; raises GenerationError."""
        gen = self.generator
        search = {k: sampling.pop(k, None) for k in ("num_beams", "num_return_sequences")}
        constraint = sampling.pop("constraint", None)
        check_one_sequence(gen.defaults, "A session", **search)  # one sequence per turn, whatever the folder asks
        params = gen.sampling_params(ignore_eos=ignore_eos, stop=stop, seed=seed, **sampling)
        if params.max_new_tokens >= self.n_positions:
            raise GenerationError(
                f"max_new_tokens={params.max_new_tokens} leaves no room for any context in the model's "
                f"{self.n_positions} positions; lower it to at most {self.n_positions - 1}."
            )
        compiled = compile_for(gen, constraint)  # this turn's text alone must match it
        self._check_idle()
        recorder = gen.logprob_recorder(logprobs, 1)
        return GenerationState(prompts=[], params=params, logprobs=recorder, constraint=compiled)

    def _steps(self, prompt: str | None, state: GenerationState) -> Iterator[Step]:
        """One turn: extend the history, feed what the cache lacks, decode; the generated tokens join the
        history however the turn ends."""
        if not self._turn.acquire(blocking=False):  # another turn runs (here or in another thread)
            self._refuse_busy()
        self._owner = threading.get_ident()
        gen, lm = self.generator, self.lm
        state.generated, state.finish_reasons = [[]], [None]
        state.texts = [TextStream(gen.tokenizer, state.params.stop)]
        try:
            if prompt:
                self._history += gen.tokenizer.encode(prompt)
            if not self._history:
                self._history = [int(gen.bos_token_id)]  # GPT-2 starts from <|endoftext|>
            self._fit(state.params.max_new_tokens)
            state.prompts = [list(self._history)]
            t0 = time.perf_counter()
            logprobs = self._feed_missing(state)
            state.prefill_ms = (time.perf_counter() - t0) * 1e3
            rng = np.random.default_rng(state.params.seed)
            for step in decode_n_tokens(lm, state, logprobs, self._mask, gen.pad_token_id, rng):
                state.wall_ms = (time.perf_counter() - t0) * 1e3
                yield step
            remember(lm, usable(lm, gen.prefix_cache, 1), self._history + state.generated[0])
        except KeyboardInterrupt:
            state.finish_reasons = [r or "interrupted" for r in state.finish_reasons]
            self._cache_valid = False  # a forward may have been cut short: rebuild the cache next turn
        finally:
            self._history += state.generated[0]
            self._owner = None
            self._turn.release()

    def _fit(self, max_new_tokens: int) -> None:
        """Drop the oldest tokens when the context and this turn's output would pass n_positions."""
        keep = kept_length(len(self._history), max_new_tokens, self.n_positions)
        if keep is None:
            return
        notice = ContextOverflow(len(self._history) - keep, keep, self.n_positions)
        self._history = self._history[-keep:]
        self._cache_valid = False  # absolute positions: the kept tokens must be prefilled from position 0
        if self.on_overflow is not None:
            self.on_overflow(notice)
        else:
            warnings.warn(notice.message(), ContextOverflowWarning, stacklevel=4)

    def _feed_missing(self, state: GenerationState) -> np.ndarray:
        """Feed the history tokens the cache lacks in one forward; returns the next token's log-probs (1, V), or
        a trimmed head's (1, K) columns (generate.decode_n_tokens maps them)."""
        lm = self.lm
        if not self._cache_valid or lm.past_len >= len(self._history):
            lm.start(1, self.n_positions)  # past_len = 0; reuses the reserved buffers
            self._cache_valid = True
        configure_head(lm, state)  # a sparse head serves this turn's steps when its parameters allow
        cache = usable(lm, self.generator.prefix_cache, 1)
        if cache is not None and lm.past_len == 0:  # a fresh cache: its longest cached prefix first
            state.cached_tokens = load_prefix(lm, cache, self._history)
        past = lm.past_len
        ids = np.asarray([self._history[past:]], dtype=np.int64)  # (1, S)
        self.last_prefill_tokens = ids.shape[1]
        positions = np.arange(past, len(self._history), dtype=np.int64)[None]  # (1, S)
        return forward_columns(lm, ids, self._mask[:, : len(self._history)], positions)

    @contextmanager
    def _idle(self) -> Iterator[None]:
        """Hold the turn lock for a call that reads or replaces the cache (save, load); refuse while a turn runs."""
        if not self._turn.acquire(blocking=False):
            self._refuse_busy()
        try:
            yield
        finally:
            self._turn.release()

    def _check_idle(self) -> None:
        if self._turn.locked():
            self._refuse_busy()

    def _refuse_busy(self) -> None:
        """A turn is running: in this thread an open stream holds it, in another a turn of its own."""
        if self._owner == threading.get_ident():
            raise GenerationError(
                "This session is in the middle of a turn (a stream is still open); exhaust or close it first."
            )
        raise GenerationError(
            "This session is running a turn in another thread; a session is one conversation for one thread at a "
            "time: give each thread its own (Generator.session()), or wait for that turn to end."
        )
