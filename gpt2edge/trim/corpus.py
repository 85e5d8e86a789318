"""Token counts of a --keep-from corpus, streamed: constant memory whatever its size, progress as it goes, and
Ctrl-C within about a second.

Files are read in blocks and decoded as UTF-8 incrementally; text is cut only where a non-space character is
followed by a space (GPT-2's pre-tokenizer never joins across such a point, so the counts equal those of the
whole file encoded at once) and encoded about a megabyte at a time. Files that are not UTF-8 text (binaries,
caches, a NUL byte: /dev/zero) are skipped, as a source tree holds some; the first bad block ends the file's
reading. Progress: a bar on a terminal, else a line every PROGRESS_EVERY_S seconds on stderr.
"""

from __future__ import annotations

import codecs
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from gpt2edge.errors import TrimError

BLOCK = 64 << 10  # bytes read at a time; a regular file up to this size is read whole
BATCH = 256 << 10  # characters encoded per call (well under a second), so Ctrl-C is felt within one
MAX_UNSPLIT = 8 << 20  # a text with no space this long (minified) is cut anyway; counts may differ there
PROGRESS_EVERY_S = 10.0


@dataclass
class CorpusCount:
    counts: np.ndarray  # (V,) int64
    files: int = 0
    skipped: int = 0
    bytes_read: int = 0


def corpus_files(paths: Sequence[Path]) -> Iterator[Path]:
    """Each file of the corpus: a file as given (a FIFO or /dev/stdin too), a folder's regular files in order."""
    for root in map(Path, paths):
        if not root.exists():
            raise TrimError(f"Corpus {root} does not exist; give a text file or a folder of text files.")
        if not root.is_dir():
            yield root
            continue
        for parent, dirs, names in os.walk(root):
            dirs.sort()
            for name in sorted(names):
                p = Path(parent) / name
                if p.is_file() and not p.is_symlink():
                    yield p


def _split_point(text: str) -> int:
    """The last index i where text[i-1] is not a space and text[i] is: a pre-token boundary; 0 when none."""
    for i in range(len(text) - 1, 0, -1):
        if text[i].isspace() and not text[i - 1].isspace():
            return i
    return 0


class _Progress:
    """A byte bar on a terminal (tqdm), else one line every PROGRESS_EVERY_S seconds."""

    def __init__(self, total: int | None) -> None:
        from tqdm import tqdm

        self.tty = sys.stderr.isatty()
        self.total = total
        self.done = 0
        self.files = 0
        self.start = self.last = time.monotonic()
        self.bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="counting corpus",
            file=sys.stderr,
            leave=False,
            disable=not self.tty,
        )

    def update(self, n: int, files: int) -> None:
        self.done += n
        self.files = files
        self.bar.update(n)
        now = time.monotonic()
        if not self.tty and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            of = f" of {self.total / 1e6:.1f} MB" if self.total else ""
            rate = self.done / 1e6 / max(now - self.start, 1e-9)
            print(
                f"trim-vocab: counted {self.done / 1e6:.1f} MB{of} ({files} file(s) done), {rate:.1f} MB/s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


def _total_size(paths: Sequence[Path]) -> int | None:
    """Bytes of the regular files, for the bar; None when a FIFO or device makes it unknown."""
    total = 0
    for p in corpus_files(paths):
        try:
            st = p.stat()
        except OSError:
            continue
        if not p.is_file():
            return None
        total += st.st_size
    return total


class _Counter:
    def __init__(self, tok: Tokenizer, vocab_size: int) -> None:
        self.tok, self.V = tok, vocab_size

    def add(self, counts: np.ndarray, texts: list[str]) -> None:
        if not texts:
            return
        for enc in self.tok.encode_batch(texts, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if ids.size and ids.max() >= self.V:
                raise TrimError(f"The tokenizer produced id {ids.max()} but the model has {self.V}; re-export it.")
            counts += np.bincount(ids, minlength=self.V)


def _count_file(path: Path, counter: _Counter, progress: _Progress, files: int) -> np.ndarray | None:
    """The counts of one file, or None when it is not UTF-8 text (skipped)."""
    counts = np.zeros(counter.V, dtype=np.int64)
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, batch, size = "", [], 0
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(BLOCK)
                progress.update(len(block), files)
                text = decoder.decode(block, final=not block)
                if "\0" in text:
                    return None
                pending += text
                cut = len(pending) if not block else _split_point(pending)
                if not cut and len(pending) > MAX_UNSPLIT:
                    cut = len(pending)
                if cut:
                    batch.append(pending[:cut])
                    size += cut
                    pending = pending[cut:]
                if size >= BATCH or not block:
                    counter.add(counts, [t for t in batch if t])
                    batch, size = [], 0
                if not block:
                    return counts
    except (OSError, UnicodeDecodeError):
        return None


def _small_text(path: Path) -> str | None:
    """The text of a regular file of at most BLOCK bytes, read whole; "" for a file not UTF-8 text (skipped)."""
    try:
        if not path.is_file() or path.stat().st_size > BLOCK:
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    return "" if "\0" in text else text


def count_corpus(tok: Tokenizer, paths: Sequence[Path], vocab_size: int) -> CorpusCount:
    """(V,) how often each id occurs in the corpus, tokenized exactly as the runtime encodes prompts. Small
    files are encoded together (tokenizers runs a batch on every core); big ones are streamed."""
    result = CorpusCount(np.zeros(vocab_size, dtype=np.int64))
    counter = _Counter(tok, vocab_size)
    progress = _Progress(_total_size(paths))
    small: list[str] = []
    size = 0
    try:
        for path in corpus_files(paths):
            text = _small_text(path)
            if text is not None:
                progress.update(len(text.encode()) if text else 0, result.files)
                if text or path.stat().st_size == 0:
                    result.files += 1
                    small.append(text)
                    size += len(text)
                else:
                    result.skipped += 1
                if size >= BATCH:
                    counter.add(result.counts, small)
                    small, size = [], 0
                continue
            counts = _count_file(path, counter, progress, result.files)
            if counts is None:
                result.skipped += 1
                continue
            result.files += 1
            result.counts += counts
        counter.add(result.counts, [t for t in small if t])
    finally:
        progress.close()
    result.bytes_read = progress.done
    if not result.counts.any():
        raise TrimError(f"The corpus {', '.join(map(str, paths))} holds no UTF-8 text; give a text file or folder.")
    return result
