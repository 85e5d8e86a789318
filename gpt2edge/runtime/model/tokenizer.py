"""The export folder's tokenizer.json through the `tokenizers` library; incremental, UTF-8-safe decoding; and
the stop-string matcher that generate() and stream() share."""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from tokenizers.pre_tokenizers import ByteLevel

from gpt2edge.errors import GenerationError, ModelFolderError

# Where GPT-2's pre-tokenizer regex always ends a piece, whatever follows: before one whitespace character
# between two non-space ones (" word", "\n" then "word"), and between an ASCII letter and an ASCII digit.
# Python's \s covers every character Rust's does, so a Python non-space is a non-space there too.
_CUT = re.compile(r"(?<=[^\s])(?=[ \n\t][^\s])|(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])")
PIECE_CHARS = 1 << 16  # characters a piece holds at least (it ends at the next cut)


def load_tokenizer(path: Path) -> Tokenizer:
    """tokenizer.json through `tokenizers`; a damaged file is a ModelFolderError (its own error is a bare Exception)."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ModelFolderError(
            f"{path} is not a readable tokenizer.json ({reason}); export the model again (or copy its tokenizer.json "
            "back)."
        ) from e


def check_vocabulary(tok: Tokenizer, path: Path, vocab_size: int | None = None) -> None:
    """An empty vocabulary (only special tokens) encodes every prompt to nothing, and a bigger one than the
    model's embedding gives ids the graph has no row for: either way tokenizer.json is not the model's."""
    if tok.get_vocab_size(with_added_tokens=False) == 0:
        raise ModelFolderError(
            f"{path} has an empty vocabulary (no text tokens): it encodes every prompt to nothing; export the model "
            "again with its own tokenizer (export --tokenizer DIR)."
        )
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and n > vocab_size:
        raise ModelFolderError(
            f"{path} has {n} tokens but the model's embedding only {vocab_size} rows: it is not the model's "
            "tokenizer; export the model again with its own tokenizer (export --tokenizer DIR)."
        )


def check_unicode(text: str, what: str = "The text") -> str:
    """A str can hold lone surrogates (argv's undecodable bytes, a JSON "\\ud800") that no tokenizer or UTF-8
    output takes: refuse them in one line. Returns the text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(
            f"{what} is not valid Unicode (lone surrogate U+{ord(text[e.start]):04X} at character {e.start}, e.g. "
            "an undecodable byte); pass UTF-8 text."
        ) from None
    return text


class TextTokenizer:
    """Encode prompts and decode ids with the exact tokenizer the model was exported with."""

    def __init__(self, path: Path, vocab_size: int | None = None):
        """vocab_size: the model's embedding rows; a tokenizer with more tokens (ids it has no row for) is refused."""
        self._tok = load_tokenizer(path)
        check_vocabulary(self._tok, path, vocab_size)
        self._max_token_bytes: int | None = 0  # 0: not computed yet

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: ~1 s for a megabyte, every thread stalls)
        return self._tok.encode_batch([check_unicode(text)], add_special_tokens=False)[0].ids

    def max_token_bytes(self) -> int | None:
        """The most bytes of input text one token stands for, so a text of B bytes has at least
        ceil(B / this) tokens. Known for byte-level BPE without a normalizer (GPT-2's: every input byte is one
        symbol, a token joins at most its own length of them, an added token matches its own bytes); None for
        other tokenizers (a normalizer can drop or merge input)."""
        if self._max_token_bytes == 0:
            byte_level = self._tok.normalizer is None and isinstance(self._tok.pre_tokenizer, ByteLevel)
            added = [len(t.content.encode()) for t in self._tok.get_added_tokens_decoder().values()]
            vocab = self._tok.get_vocab(with_added_tokens=False)
            self._max_token_bytes = max([*map(len, vocab), *added, 1]) if byte_level else None
        return self._max_token_bytes

    def encode_long(self, text: str, piece_chars: int = PIECE_CHARS) -> array:
        """The ids of a long text (a corpus to score), tokenized a piece at a time: `tokenizers` holds ~300
        bytes a token while it encodes (2 MB of base64 took 600 MB), the ids kept here 4. The pieces are cut
        only where GPT-2's pre-tokenizer always cuts, so the ids equal encode(text); a tokenizer of another
        kind is encoded whole."""
        check_unicode(text)
        out = array("i")
        start = 0
        while start < len(text):
            cut = _CUT.search(text, start + piece_chars) if self._cuttable and piece_chars > 0 else None
            end = cut.start() if cut is not None else len(text)
            out.extend(self._tok.encode(text[start:end], add_special_tokens=False).ids)
            start = end
        return out

    @cached_property
    def _cuttable(self) -> bool:
        """Whether a text may be cut at _CUT: GPT-2's byte-level pre-tokenizer (its regex, no prefix space, no
        normalizer), and no added token that a cut could fall inside."""
        pre = self._tok.pre_tokenizer
        if type(pre).__name__ != "ByteLevel" or not pre.use_regex or pre.add_prefix_space or self._tok.normalizer:
            return False
        return not any(_CUT.search(t.content) for t in self._tok.get_added_tokens_decoder().values())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Turns token ids, one at a time, into text pieces that never split a character.

    A multi-byte character (CJK, emoji) can span several byte-level tokens. `tokenizers`' DecodeStream holds
    such tokens back until the character is complete and decodes only a short window of recent ids per token
    (the whole text is never re-decoded), so the concatenated pieces plus flush() equal decode(all ids).
    """

    def __init__(self, tokenizer: TextTokenizer):
        self._tok = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self._pending: list[int] = []  # ids pushed since the last piece: an incomplete character, if any

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is now safe to print (possibly empty)."""
        piece = self._stream.step(self._tok, int(token_id))
        if piece is None:
            self._pending.append(int(token_id))  # wait for the rest of the character
            return ""
        self._pending.clear()
        return piece

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character comes out as U+FFFD, as decode gives it).
        The pending ids start on a character boundary, so decoding them alone gives the end of the text."""
        piece = self._tok.decode(self._pending, skip_special_tokens=True) if self._pending else ""
        self._pending.clear()
        return piece


class TextStream:
    """Token ids in; text, stop-string detection and printable pieces out. One per generated row.

    The one stop matcher: generate() takes its `text`, stream() its `take()` pieces, and the generate loop asks
    push() whether a stop string has appeared, so both paths agree on the text and the finish reason. It matches
    on the decoded text, incrementally: after each token only the new characters and the (longest stop - 1)
    before them are searched, so a stop string is found however many tokens it was split over.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: str | Sequence[str] = ()):
        self._decoder = StreamDecoder(tokenizer)
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop)  # a plain string is one stop string
        self._longest = max(map(len, self.stop), default=0)
        self._text = ""  # everything decoded so far (whole characters)
        self.stop_at: int | None = None  # where the earliest stop string begins in the text, once one has
        self._taken = 0  # characters already handed out by take()
        self._finished = False

    def push(self, token_id: int) -> bool:
        """Add one generated token; True once a stop string has appeared (later tokens are then ignored)."""
        if self.stop_at is None and not self._finished:
            self._append(self._decoder.push(token_id))
        return self.stop_at is not None

    def finish(self) -> None:
        """The row is over: release an incomplete last character (as U+FFFD). Idempotent."""
        if not self._finished and self.stop_at is None:
            self._append(self._decoder.flush())
        self._finished = True

    @property
    def text(self) -> str:
        """The generated text, cut before the stop string if one was found (OpenAI's convention)."""
        return self._text if self.stop_at is None else self._text[: self.stop_at]

    def take(self) -> str:
        """New text that is safe to print: never past a stop string, and holding back a suffix that could still
        become the start of one (released at finish() if it does not)."""
        if self.stop_at is not None:
            end = self.stop_at
        elif self._finished:
            end = len(self._text)
        else:
            end = len(self._text) - self._held()
        piece = self._text[self._taken : end]
        self._taken = max(self._taken, end)
        return piece

    def _append(self, piece: str) -> None:
        if not piece:
            return
        # a stop string not present before must end in the new piece, so it starts at most longest-1 back
        start = max(0, len(self._text) - self._longest + 1)
        self._text += piece
        hits = [i for s in self.stop if (i := self._text.find(s, start)) >= 0]
        if hits:
            self.stop_at = min(hits)

    def _held(self) -> int:
        """Length of the longest suffix of the untaken text that is a proper prefix of some stop string."""
        room = min(self._longest - 1, len(self._text) - self._taken)
        for n in range(room, 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
