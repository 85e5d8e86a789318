"""SamplingParams: the generation options, named and defaulted as transformers' GenerationConfig, checked once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpt2edge.errors import GenerationError

# beam search's early_stopping values by name (transformers': True, False, "never"), here beside the other options'
# definitions so that the CLI declares --early-stopping without importing the decoding loops
_EARLY_STOPPING = {"true": True, "false": False, "never": "never"}
EARLY_STOPPING_NAMES = tuple(_EARLY_STOPPING)  # what the CLI's --early-stopping takes


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and bool(np.isfinite(v))


def _token_sequences(value: object) -> tuple[tuple[int, ...], ...] | None:
    """bad_words_ids as a tuple of non-empty tuples of ids >= 0, or None when it is not that shape."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return None
    out = []
    for seq in value:
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or not len(seq):
            return None
        if not all(_is_int(t) and t >= 0 for t in seq):
            return None
        out.append(tuple(int(t) for t in seq))
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """What transformers' GenerationConfig calls these, with its defaults. temperature 0 means greedy.

    Off values: top_k 0, top_p 1.0, min_p None, typical_p 1.0, repetition_penalty 1.0, no_repeat_ngram_size 0,
    bad_words_ids () (token-id sequences that must never be generated).
    """

    max_new_tokens: int = 32
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float | None = None
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    eos_token_id: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's, on the generated tokens (runtime/decoding/row_penalties.py)
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) pairs or a dict {id: bias}
    stop_token_ids: tuple[int, ...] = ()  # end a row as end-of-text does (held back by min_new_tokens)

    @property
    def row_penalties(self) -> bool:
        """Whether per-row penalties, logit_bias or stop_token_ids are set (RowPenalties applies them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.stop_token_ids)

    def __post_init__(self) -> None:
        # raised before any model work, each naming the bad value and the valid range
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}.")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise GenerationError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}.")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}.")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}.")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1] (1.0 disables it), got {self.top_p!r}.")
        if self.min_p is not None and (not _is_real(self.min_p) or not 0 < self.min_p <= 1):
            raise GenerationError(f"min_p must be in (0, 1] (unset disables it), got {self.min_p!r}.")
        if not _is_real(self.typical_p) or not 0 < self.typical_p <= 1:
            raise GenerationError(f"typical_p must be in (0, 1] (1.0 disables it), got {self.typical_p!r}.")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise GenerationError(f"repetition_penalty must be > 0 (1.0 disables it), got {self.repetition_penalty!r}.")
        if not _is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            raise GenerationError(
                f"no_repeat_ngram_size must be an integer >= 0 (0 disables it), got {self.no_repeat_ngram_size!r}."
            )
        bad = _token_sequences(self.bad_words_ids)
        if bad is None:
            raise GenerationError(
                "bad_words_ids must be a list of non-empty lists of token ids >= 0, e.g. [[1234], [50, 9]]; "
                f"got {self.bad_words_ids!r}."
            )
        object.__setattr__(self, "bad_words_ids", bad)  # lists from JSON become hashable tuples
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise GenerationError(f"seed must be an integer >= 0 (or unset for a random one), got {self.seed!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise GenerationError(f"{name} must be in [-2, 2] (0 disables it), got {getattr(self, name)!r}.")
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            pairs = tuple((t, b) for t, b in items)
        except (TypeError, ValueError):
            raise GenerationError(f"logit_bias must be (id, bias) pairs or {{id: bias}}: {self.logit_bias!r}") from None
        for t, b in pairs:
            if not _is_int(t) or t < 0 or not _is_real(b) or not -100 <= b <= 100:
                raise GenerationError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {t!r}: {b!r}.")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in pairs))
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise GenerationError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}.")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            raise GenerationError("Stop strings must not be empty.")

    @property
    def greedy(self) -> bool:
        """Argmax after the processors; the warpers (temperature, top-k, ...) only run when sampling."""
        return not self.do_sample or self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """Whether next_tokens reads the generated ids (so the caller must append them to each row's history)."""
        multi_token_bad_word = any(len(s) > 1 for s in self.bad_words_ids)
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or multi_token_bad_word

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary (known only once the model is loaded)."""
        bad_ids = [t for s in self.bad_words_ids for t in s]
        named = (("bad_words_ids", bad_ids), ("eos_token_id", self.eos_token_id),
                 ("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids))  # fmt: skip
        for name, ids in named:
            too_big = sorted({int(t) for t in ids if t >= vocab_size})
            if too_big:
                raise GenerationError(
                    f"{name} holds token id(s) {too_big[:5]}, but the model's vocabulary has {vocab_size} tokens "
                    f"(ids 0..{vocab_size - 1})."
                )
