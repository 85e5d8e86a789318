"""Bounded reads of text inputs: a huge file, /dev/zero or a FIFO that never ends is read only up to a limit.

Prompt files and stdin (generate -f / -p -) and the text `score` reads are refused beyond their limit (reading
stops there, so an endless input ends too); a report text (quantize / trim-vocab / parity --text), of which a
quality report scores a few hundred tokens, is cut at its limit with a note saying so.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import BinaryIO

from gpt2edge.errors import GenerationError

MAX_PROMPT_BYTES = 64 << 20  # a prompt file or stdin: far more than a batch of n_positions-token prompts
MAX_SCORE_BYTES = 64 << 20  # ~16M tokens: hours of scoring on a CPU; score a part of a bigger corpus
MAX_REPORT_TEXT_BYTES = 1 << 20  # a quality report scores at most n_positions tokens of its --text
_READ = 1 << 20


def read_capped(f: BinaryIO, limit: int) -> tuple[bytes, bool]:
    """At most `limit` bytes of the stream, and whether more followed (one byte past the limit is read)."""
    chunks, n = [], 0
    buffered = isinstance(f, io.BufferedIOBase)  # its read(k) returns fewer than k bytes only at end of input
    while n <= limit:
        want = min(_READ, limit + 1 - n)
        block = f.read(want)
        if not block:
            break
        chunks.append(block)
        n += len(block)
        if buffered and len(block) < want:  # ended: on a terminal another read would wait for a second Ctrl-D
            break
    data = b"".join(chunks)
    return data[:limit], len(data) > limit


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def read_limited(source: str | Path | BinaryIO, limit: int, what: str, hint: str) -> bytes:
    """The whole input, or a GenerationError when it holds more than `limit` bytes (reading stops there)."""
    try:
        if isinstance(source, (str, Path)):
            with open(source, "rb") as f:
                data, more = read_capped(f, limit)
        else:
            data, more = read_capped(source, limit)
    except OSError as e:
        raise GenerationError(f"Cannot read {what} ({e.strerror or e}).") from None
    if more:
        raise GenerationError(f"{what} holds more than {_mb(limit)} (reading stopped there); {hint}")
    return data


def _whole_chars(data: bytes) -> bytes:
    """`data` without a character cut in half at its end (a bad byte elsewhere is left for the decoder)."""
    for cut in range(min(4, len(data))):
        try:
            data[: len(data) - cut].decode("utf-8")
            return data[: len(data) - cut]
        except UnicodeDecodeError as e:
            if e.start < len(data) - 4:
                return data
    return data


def read_prefix_text(path: str | Path, limit: int, what: str) -> tuple[bytes, bool]:
    """At most `limit` bytes of the file, cut back to a whole UTF-8 character, and whether it was cut; a note
    on stderr says so."""
    try:
        with open(path, "rb") as f:
            data, more = read_capped(f, limit)
    except OSError as e:
        raise GenerationError(f"Cannot read the {what} file {path} ({e.strerror or e}).") from None
    if more:
        data = _whole_chars(data)
        print(
            f"note: the {what} file {path} is over {_mb(limit)}; its first {_mb(len(data))} is used (a quality "
            "report scores a few hundred tokens).",
            file=sys.stderr,
        )
    return data, more
