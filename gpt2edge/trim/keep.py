"""Which token ids a trimmed head keeps: from a corpus (--keep-from) or an explicit list (--keep-ids).

Always kept, whatever the source: the byte-level single-byte tokens (every byte of any text has one, so the
trimmed model can still spell anything), and EOS (so generation can end). --keep-from also keeps every special
token; a --keep-ids list must name EOS itself and is refused without it (a list that forgot EOS is a mistake
the user should see, not one to paper over). Needs tokenizers and numpy only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers

from gpt2edge.errors import TrimError
from gpt2edge.runtime.model.tokenizer import load_tokenizer
from gpt2edge.trim.corpus import count_corpus


@dataclass(frozen=True)
class KeepSet:
    """The kept ids (ascending, int64) and where they came from, for the manifest."""

    ids: np.ndarray
    eos: tuple[int, ...]
    byte_tokens: int  # single-byte tokens added (all of them, whether or not the source named them)
    special: tuple[int, ...] = ()
    source: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.source,
            "kept": int(self.ids.size),
            "always_kept": {"eos": list(self.eos), "byte_tokens": self.byte_tokens, "special": list(self.special)},
        }


def byte_token_ids(tok: Tokenizer) -> list[int]:
    """Ids of the tokens whose string is one character of the ByteLevel alphabet (one byte each)."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    return sorted(i for t, i in tok.get_vocab(with_added_tokens=False).items() if len(t) == 1 and t in alphabet)


def special_token_ids(tokenizer_json: Path) -> list[int]:
    """Ids of the tokenizer's added tokens marked special (<|endoftext|> for GPT-2)."""
    data = json.loads(Path(tokenizer_json).read_text())
    return sorted(int(t["id"]) for t in data.get("added_tokens", []) if t.get("special"))


def read_id_list(path: Path) -> list[int]:
    """Token ids from a .npy array, a JSON array, or text with ids separated by spaces, commas or newlines."""
    path = Path(path)
    try:
        if path.suffix == ".npy":
            arr = np.load(path, allow_pickle=False)
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise TrimError(f"{path} must hold a 1-D integer array of token ids, got {arr.dtype} {arr.shape}.")
            return [int(x) for x in arr]
        text = path.read_text()
    except (OSError, ValueError) as e:
        raise TrimError(f"Cannot read the keep-list {path} ({e}); give a .npy, JSON or text file of ids.") from e
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except (ValueError, RecursionError) as e:  # bad JSON, an int of over 4300 digits; arrays nested too deep
            raise TrimError(f"{path} is not a valid JSON array of token ids ({e}).") from e
    else:
        items = stripped.replace(",", " ").split()
    ids = []
    for x in items:
        try:  # int() of a str refuses '²' (a digit to isdigit) and more than 4300 digits
            digits = isinstance(x, str) and x.lstrip("-").isdigit()
            if isinstance(x, bool) or not (isinstance(x, int) or digits):
                raise ValueError
            ids.append(int(x))
        except ValueError:
            shown = repr(x) if len(repr(x)) <= 40 else repr(x)[:37] + "..."
            raise TrimError(f"{path}: {shown} is not a token id; the keep-list holds integers only.") from None
    if not ids:
        raise TrimError(f"The keep-list {path} is empty; list the token ids to keep.")
    return ids


def _finish(
    chosen: Sequence[int], tok: Tokenizer, vocab_size: int, eos: Sequence[int], special: Sequence[int], source: dict
) -> KeepSet:
    """Add the always-kept ids, sort, and refuse a set that keeps everything (nothing would be trimmed)."""
    byte_ids = byte_token_ids(tok)
    ids = np.unique(np.asarray([*chosen, *byte_ids, *eos, *special], dtype=np.int64))
    if ids.size >= vocab_size:
        raise TrimError(
            f"The keep-list covers all {vocab_size} tokens, so nothing would be trimmed; keep fewer (e.g. --top N)."
        )
    return KeepSet(ids, tuple(eos), len(byte_ids), tuple(special), source)


def keep_from_corpus(
    tokenizer_json: Path, vocab_size: int, eos: Sequence[int], corpus: Sequence[Path], top: int | None = None
) -> KeepSet:
    """The tokens the corpus uses (its `top` most frequent when given), plus bytes, EOS and special tokens."""
    if top is not None and top < 1:
        raise TrimError(f"--top must be >= 1, got {top}.")
    tok = load_tokenizer(tokenizer_json)
    counted = count_corpus(tok, corpus, vocab_size)  # streamed: constant memory, progress, Ctrl-C
    counts = counted.counts
    seen = np.flatnonzero(counts)
    if top is not None:
        order = np.lexsort((seen, -counts[seen]))  # most frequent first, ties by id
        seen = seen[order[:top]]
    source = {
        "keep_from": [str(Path(p).resolve()) for p in corpus],
        "top": top,
        "corpus_files": counted.files,
        "corpus_files_skipped": counted.skipped,
        "corpus_tokens": int(counts.sum()),
        "corpus_distinct_tokens": int(np.count_nonzero(counts)),
    }
    return _finish(seen.tolist(), tok, vocab_size, eos, special_token_ids(tokenizer_json), source)


def keep_from_ids(tokenizer_json: Path, vocab_size: int, eos: Sequence[int], path: Path) -> KeepSet:
    """An explicit keep-list: every id must exist, EOS must be listed; the single-byte tokens are added."""
    ids = read_id_list(path)
    unknown = sorted({i for i in ids if not 0 <= i < vocab_size})
    if unknown:
        shown = ", ".join(map(str, unknown[:5])) + (" ..." if len(unknown) > 5 else "")
        raise TrimError(
            f"{path} lists {len(unknown)} unknown token id(s) ({shown}); the model's ids are 0..{vocab_size - 1}."
        )
    missing = [e for e in eos if e not in set(ids)]
    if missing:
        raise TrimError(
            f"{path} does not keep the end-of-text token (id {', '.join(map(str, missing))}); add it, or the trimmed "
            "model could never end a text."
        )
    tok = load_tokenizer(tokenizer_json)
    return _finish(ids, tok, vocab_size, eos, (), {"keep_ids": str(Path(path).resolve()), "listed": len(set(ids))})
