"""Per-token log-probs of a generation: for each generated token, its log-prob under the model and the N most
likely alternatives with theirs (OpenAI's `logprobs`, llama.cpp's `--n-probs`, transformers' `output_scores`).

The values are the graph's own output, a log_softmax over the vocabulary, read before any sampling processor
(repetition penalty, temperature, top-k/top-p, min_new_tokens): what the model thinks, not what the sampler
drew from, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer, decoders

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.model.columns import Columns
from gpt2edge.runtime.model.tokenizer import TextTokenizer


@dataclass
class TopLogprob:
    """One of the N most likely tokens at a step. `token` is that token decoded alone (part of a multi-byte
    character decodes to U+FFFD; special tokens such as <|endoftext|> are kept); `bytes` are its UTF-8 bytes,
    so the bytes of consecutive tokens join into the exact text even where a character spans tokens."""

    token_id: int
    token: str
    logprob: float
    bytes: list[int]


@dataclass
class TokenLogprob:
    """One generated token: its natural-log probability under the model and the top alternatives (most likely
    first; equal log-probs ordered by id). top_logprobs is empty when N = 0."""

    token_id: int
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = field(default_factory=list)


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    others = [b for b in range(256) if b not in printable]  # mapped, in order, to 256, 257, ...
    table = dict(zip(printable, chars)) | {b: 256 + i for i, b in enumerate(others)}
    return {chr(c): b for b, c in table.items()}


def token_bytes(tokenizer: Tokenizer, token_id: int, text: str, table: dict[str, int]) -> list[int]:
    """A byte-level BPE token's own bytes (its vocabulary entry spelled in GPT-2's alphabet); otherwise, and for
    special tokens, the UTF-8 of its text."""
    piece = tokenizer.id_to_token(token_id)
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    if not byte_level or piece is None or piece == text or any(c not in table for c in piece):
        return list(text.encode())
    return [table[c] for c in piece]


def check_logprobs(n: int | None, vocab_size: int) -> None:
    """None (off) or an integer in 0 .. vocab_size; anything else is a one-line error."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= vocab_size:
        raise GenerationError(
            f"logprobs must be an integer from 0 (the chosen token only) to {vocab_size} (the vocabulary size), "
            f"got {n!r}."
        )


def top_ids(row: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest entries of a (V,) row, largest first; ties ordered by id. Tokens of probability 0
    (-inf: the ids a vocabulary-trimmed head dropped) are never listed, so fewer than n may come back."""
    n = min(n, int(np.count_nonzero(row > -np.inf)))  # the impossible tokens sort last: cut them off
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    cand = np.arange(row.size) if n >= row.size else np.argpartition(-row, n - 1)[:n]
    # a tie with the n-th value may leave a larger id in the partition than a smaller one outside it: widen
    cand = np.union1d(cand, np.flatnonzero(row == row[cand].min()))
    order = np.lexsort((cand, -row[cand]))  # by value descending, then by id
    return cand[order][:n].astype(np.int64)


class LogprobRecorder:
    """Collects TokenLogprob records, row by row, during one generation (the generate loop calls record())."""

    def __init__(self, tokenizer: TextTokenizer, n: int, batch: int) -> None:
        self.n = n
        self.rows: list[list[TokenLogprob]] = [[] for _ in range(batch)]
        self._tokenizer = tokenizer
        self._tokens: dict[int, tuple[str, list[int]]] = {}  # id -> (its text, its bytes), worked out once
        self._bytes = byte_decoder()

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token."""
        entry = self._tokens.get(token_id)
        if entry is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            raw = token_bytes(self._tokenizer._tok, token_id, text, self._bytes)
            entry = self._tokens[token_id] = (text, raw)
        return entry

    def record(
        self, logprobs: np.ndarray, tokens: np.ndarray, active: Sequence[bool], columns: Columns | None = None
    ) -> list[TokenLogprob | None]:
        """(B, V) log-probs the step's tokens were chosen from ((B, K) columns of a trimmed head, with `columns`),
        (B,) full token ids, (B,) rows that took their token. Returns this step's record of each row (None for a
        row that took no token), for a per-step consumer."""
        step: list[TokenLogprob | None] = [None] * len(tokens)
        for b in np.flatnonzero(active):
            row, tok = logprobs[b], int(tokens[b])
            top = top_ids(row, self.n)  # columns ascending like their ids: ties come out in id order either way
            top = top if columns is None else columns.ids[top]
            top = [TopLogprob(int(i), *self._entry(row, int(i), columns)) for i in top]
            step[b] = TokenLogprob(tok, *self._entry(row, tok, columns), top)
            self.rows[b].append(step[b])
        return step

    def _entry(self, row: np.ndarray, token_id: int, columns: Columns | None) -> tuple[str, float, list[int]]:
        text, raw = self.token(token_id)
        value = float(row[token_id]) if columns is None else columns.value(row, token_id)
        return text, value, list(raw)
