"""One completion's text as its tokens arrive: never half a character, and cut before a stop string.

Stop strings are applied here, per row, rather than by the runtime, because rows of one batch belong to
different requests with different stop lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"  # what a byte-level decode yields for an incomplete UTF-8 sequence


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDecoder:
    """Token ids in, text pieces out, decoding only a short window (constant work per token).

    Byte-level BPE decodes to the concatenation of its tokens' bytes, so the text a new token adds is
    decode(window + token) minus decode(window). A piece ending in U+FFFD is held until the character is
    complete; flush() releases whatever is left, exactly as a full decode would render it.
    """

    def __init__(self, tokenizer: Decoder) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: a few tokens of context before the unreleased ones
        self._read = 0  # tokens before this index are released as text

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) <= len(done) or text.endswith(REPLACEMENT):
            return ""  # wait for the rest of the character
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def flush(self) -> str:
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(done) :]


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """Text before the earliest stop string (OpenAI returns the text without it)."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def held_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that could be the start of a stop string."""
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class RowText:
    """push(token) -> (text safe to send now, whether a stop string ended the row); finish() -> the rest."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self._stop = tuple(stop)
        self._held = ""  # decoded text withheld because it may be the start of a stop string

    def push(self, token_id: int) -> tuple[str, bool]:
        text = self._held + self._decoder.push(token_id)
        if not self._stop:
            return text, False
        cut = cut_at_stop(text, self._stop)
        if len(cut) < len(text):
            self._held = ""
            return cut, True
        n = held_suffix(text, self._stop)
        self._held = text[len(text) - n :] if n else ""
        return text[: len(text) - n], False

    def finish(self) -> str:
        text, self._held = self._held + self._decoder.flush(), ""
        return cut_at_stop(text, self._stop)
