"""The export folder's tokenizer.json through the `tokenizers` library, plus UTF-8-safe streaming decode."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"  # what a byte-level decode yields for an incomplete UTF-8 sequence


class TextTokenizer:
    """Encode prompts and decode ids with the exact tokenizer the model was exported with."""

    def __init__(self, path: Path):
        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class StreamDecoder:
    """Turns a growing list of token ids into text pieces that never split a character.

    A multi-byte character (CJK, emoji) can span several byte-level tokens; decoding a prefix then ends in
    U+FFFD. Text is released only up to a point that decodes cleanly, so the concatenated pieces equal the
    final decode exactly.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already handed out

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is now safe to print (possibly empty)."""
        self._ids.append(int(token_id))
        text = self._tok.decode(self._ids)
        if text.endswith(REPLACEMENT):
            return ""  # wait for the rest of the character
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is released as U+FFFD, as decode gives it)."""
        text = self._tok.decode(self._ids)
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece
