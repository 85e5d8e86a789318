"""A choice's log-probs in OpenAI's legacy completions format, kept in step with the text actually sent.

Each generated token goes out with the piece of text that holds its first character, so a token whose text is
held back (half a UTF-8 character, or what may be the start of a stop string) is held back with it. A choice
reports the tokens from its first to the last one whose bytes reach its returned text: tokens after a stop
string's cut (which spelled only the stop string) and the end-of-text token are not part of it.
"""

from __future__ import annotations

import codecs
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpt2edge.runtime.decoding.logprobs import TokenLogprob


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


FLOOR = -9999.0  # OpenAI's stand-in for a log-prob of -inf (a token the model gives probability 0; JSON has no inf)


def spell(raw: Sequence[int], token_id: int) -> str:
    """OpenAI's name for a token: its text, or `bytes:\\xe2\\x80` when its bytes are not whole UTF-8 alone
    (part of a character split over tokens), or `<|id:N|>` when it has no bytes at all (an id past the
    tokenizer's vocabulary: a padded vocabulary). Distinct tokens keep distinct names, as top_logprobs keys."""
    data = bytes(raw)
    if not data:
        return f"<|id:{token_id}|>"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


@dataclass(frozen=True)
class TokenEntry:
    """One reported token: OpenAI's tokens[i], token_logprobs[i], top_logprobs[i] (None when logprobs is 0)
    and text_offset[i] (characters from the start of the prompt)."""

    token: str
    logprob: float
    top: dict[str, float] | None
    offset: int
    renders: bool  # its bytes are part of the text (False: end of text, or an id that decodes to nothing)


def token_entry(record: TokenLogprob, n: int, offset: int, renders: bool) -> TokenEntry:
    """The runtime's record as a reported token; top holds its n most likely tokens and always the chosen one
    (so up to n + 1 entries, as OpenAI says)."""
    top = None
    if n:
        top = {spell(t.bytes, t.token_id): _finite(t.logprob) for t in record.top_logprobs[:n]}
        top.setdefault(spell(record.bytes, record.token_id), _finite(record.logprob))
    return TokenEntry(spell(record.bytes, record.token_id), _finite(record.logprob), top, offset, renders)


class ChoiceLogprobs:
    """push(record) for each generated token; take(sent) -> the tokens that start within the first `sent`
    characters of the completion, not handed out before; finish(sent) -> the last of them, once the text is
    final (sent is its length).

    A token starts at the character that holds its first byte in the completion's text, which is the lossy
    UTF-8 decoding of all its tokens' bytes (what the tokenizer renders): an incremental UTF-8 decoder fed
    token by token says how many characters the bytes before a token have completed, and whether its first
    byte continues one that is still incomplete.
    """

    def __init__(self, tokenizer: Decoder, n: int, prompt_chars: int) -> None:
        self.n = n
        self._tok = tokenizer
        self._base = prompt_chars  # OpenAI counts text_offset from the start of the prompt
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0  # characters completed by the bytes so far (an invalid byte completes a U+FFFD)
        self._pending: deque[TokenEntry] = deque()

    def push(self, record: TokenLogprob) -> None:
        # a special token (end of text) or an id past the vocabulary renders as nothing in the text
        renders = self._tok.decode([record.token_id]) != ""
        start = self._start(bytes(record.bytes) if renders else b"")
        self._pending.append(token_entry(record, self.n, self._base + start, renders))

    def _start(self, raw: bytes) -> int:
        """Index of the character that holds raw's first byte; then take raw in."""
        if not raw:
            return self._chars
        emitted = len(self._utf8.decode(raw[:1]))
        held = bool(self._utf8.getstate()[0])  # the byte opens (or continues) a character still incomplete
        start = self._chars + emitted - (0 if held else 1)
        self._chars += emitted + len(self._utf8.decode(raw[1:]))
        return start

    def take(self, sent: int) -> list[TokenEntry]:
        out = []
        while self._pending and self._pending[0].offset < self._base + sent:
            out.append(self._pending.popleft())
        return out

    def finish(self, sent: int) -> list[TokenEntry]:
        out = self.take(sent)
        while out and not out[-1].renders:  # end of text after an incomplete last character
            out.pop()
        self._pending.clear()  # beyond the returned text: a stop string's tokens, end of text
        return out


def logprobs_body(entries: Sequence[TokenEntry], n: int) -> dict:
    """OpenAI's legacy `logprobs` object of one choice (or of one streamed chunk of it)."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [e.top for e in entries] if n else None,  # logprobs: 0 -> null, as OpenAI answers
        "text_offset": [e.offset for e in entries],
    }
