"""Constraints compiled by llguidance (no torch: NumPy bitmasks), kept in a bounded cache, one matcher per row.

llguidance is imported only when a constraint is used; without it, one line names `pip install
'gpt2edge[structured]'`. The engine's tokenizer is built once per TextTokenizer from its tokenizer.json (no
transformers). A compiled constraint is a matcher fresh from its grammar; each generated row gets a deep copy
(cheap: the grammar and lexer are shared), so a repeated schema compiles once (CACHE_SIZE entries, least
recently used first out, keyed by kind, text and the tokenizer's digest).
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpt2edge.extras import require_extra
from gpt2edge.runtime.constraints.spec import Constraint, ConstraintError, as_constraint
from gpt2edge.runtime.model.tokenizer import TextTokenizer

CACHE_SIZE = 64
# JSON is generated compact (',' and ':' with no whitespace around them): a free whitespace run is where a
# small model loops; a schema's own "x-guidance" options override this
JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's slicer: each slice's tokens are added to a mask at once, without walking their trie, where the
# grammar allows the whole slice (docs/optimizations.md of llguidance). Its general slices are JSON strings'
# characters; these two, before them, are words and spaces (lower case, then any case), for prose-like classes
# (on GPT-2's vocabulary, AMD Zen 1: `[A-Za-z ,.]{1,200}` 1.2 -> 0.05 ms a mask, `[a-z ]{1,120}` 0.55 -> 0.05;
# JSON Schemas unchanged; the masks are the same: tests/runtime/test_structured.py)
WORD_SLICES = ["[ a-z]{1,20}", "[ A-Za-z]{1,20}"]
_lock = threading.Lock()
_cache: OrderedDict[tuple, CompiledConstraint] = OrderedDict()
_counts = {"hits": 0, "misses": 0}  # cache look-ups since the process started (the server's /metrics-style stats)
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TextTokenizer -> (digest, LLTokenizer)
_executor = None  # the one llguidance thread pool (_shared_executor)


def _llg():
    """The llguidance module, or one line naming the extra that installs it."""
    require_extra("structured", "structured output (a JSON Schema, regex, choice or grammar constraint)")
    import llguidance

    return llguidance


@functools.cache
def _llg_numpy():
    """llguidance's NumPy bitmask functions (imported once: an import statement per mask costs what the mask does)."""
    _llg()
    import llguidance.numpy

    return llguidance.numpy


def limits():
    """The engine's resource limits: llguidance's defaults (lexer fuel ~20 ms of compile work, 250k lexer states,
    500k grammar symbols), with short error messages (no parser dump)."""
    return _llg().LLParserLimits(verbose_errors=False)


def first_line(message: str, limit: int = 300) -> str:
    """An engine message as one line: its first line, and the `error: ...` line of a regex parser's report."""
    lines = [s.strip() for s in str(message).splitlines() if s.strip()]
    line = " ".join(lines[:1] + [s for s in lines[1:] if s.startswith("error:")]) or "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def engine_tokenizer(tokenizer: TextTokenizer, eos: Sequence[int]) -> tuple[str, Any]:
    """(digest, llguidance LLTokenizer) of this tokenizer, built once (a 50k vocabulary takes ~1 s)."""
    with _lock:
        hit = _tokenizers.get(tokenizer)
    if hit is not None:
        return hit
    llg = _llg()
    text = tokenizer._tok.to_str()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    n_vocab = tokenizer._tok.get_vocab_size(with_added_tokens=True)
    slices = WORD_SLICES + llg.LLTokenizer.general_slices()
    built = (digest, llg.LLTokenizer(text, n_vocab=n_vocab, eos_token=list(eos) or None, slices=slices))
    with _lock:
        _tokenizers[tokenizer] = built
    return built


def _shared_executor(llg):
    """One llguidance thread pool for every compiled constraint: a pool each (rayon starts its threads at once)
    would let a client with many distinct schemas start thousands of threads."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = llg.LLExecutor()
        return _executor


def _grammar(llg, c: Constraint) -> str:
    """The constraint as an llguidance grammar; a GBNF file that does not convert is refused in one line."""
    if c.kind in ("json_schema", "json_object"):
        return llg.LLMatcher.grammar_from_json_schema(c.text, defaults=JSON_OPTIONS)
    if c.kind == "gbnf":
        try:
            return llg.grammar_from("gbnf", c.text)
        except Exception as e:  # llguidance's converter raises plain Exceptions
            raise ConstraintError(f"The GBNF grammar does not convert: {first_line(e)}") from None
    return llg.grammar_from(c.kind, c.text)


def _refusal(c: Constraint, error: str) -> ConstraintError:
    """The engine's reason as one line; unimplemented JSON Schema keywords named as such."""
    keys = re.search(r"Unimplemented keys: \[(.*?)\]", error)
    if keys:
        names = ", ".join(k.strip().strip('"') for k in keys.group(1).split(","))
        return ConstraintError(f"The JSON Schema uses keyword(s) the engine does not support: {names}.")
    what = {"json_schema": "JSON Schema", "json_object": "JSON object", "choice": "choice list"}.get(c.kind, c.kind)
    return ConstraintError(f"The {what} constraint is refused by the engine: {first_line(error)}")


@dataclass(eq=False)
class CompiledConstraint:
    """A constraint compiled for one tokenizer and model vocabulary; matcher() gives a row its own state."""

    constraint: Constraint
    template: Any  # a fresh llguidance LLMatcher
    vocab_size: int  # the model's (its head's) vocabulary; ids past the tokenizer's are never allowed
    engine_eos: tuple[int, ...]  # the tokens the engine treats as end of text
    engine_vocab: int = 0  # the tokenizer's vocabulary: the engine's mask width
    compile_ms: float = 0.0
    executor: Any = field(default=None, repr=False)

    def matcher(self) -> RowMatcher:
        return RowMatcher(self, self.template.deep_copy())


class RowMatcher:
    """One row's grammar state: the allowed tokens now, advance by a token, roll back, accepting or done."""

    def __init__(self, compiled: CompiledConstraint, matcher: Any):
        self.compiled, self._m = compiled, matcher
        self.n_tokens = 0
        self.dead = False  # a beam that took a token its grammar refuses (beam search ends it)

    def copy(self) -> RowMatcher:
        """An independent matcher in this one's state (a beam search's new beam)."""
        out = RowMatcher(self.compiled, self._m.deep_copy())
        out.n_tokens, out.dead = self.n_tokens, self.dead
        return out

    def try_advance(self, token: int) -> bool:
        """advance(), False instead of an error when the grammar refuses the token (or the row is dead)."""
        if self.dead or not self._m.consume_token(int(token)):
            return False
        self.n_tokens += 1
        return True

    def allowed(self, eos_ids: Sequence[int] = ()) -> np.ndarray:
        """(vocab_size,) bool: the tokens that keep the text a prefix of the language; `eos_ids` (the call's end
        tokens) only where the text is complete. An empty row means the grammar is done."""
        return allowed_masks([self], eos_ids)[0]

    def advance(self, token: int) -> None:
        """Consume a generated token (an end token is consumed too; the engine then stops)."""
        if not self._m.consume_token(int(token)):
            raise ConstraintError(f"Token {int(token)} breaks the constraint: {first_line(self._m.get_error())}")
        self.n_tokens += 1

    def rollback(self, n: int) -> None:
        """Undo the last n advances (a speculative draft's rejected tail)."""
        if n > self.n_tokens or not self._m.rollback(int(n)):
            raise ConstraintError(f"Cannot roll the constraint back by {n} tokens.")
        self.n_tokens -= n

    @property
    def accepts_eos(self) -> bool:
        """The text so far is a whole sentence of the language: it may end here."""
        return bool(self._m.is_accepting())

    @property
    def done(self) -> bool:
        """The language has no longer sentence: the row must end (finish reason "stop")."""
        return bool(self._m.is_stopped())

    def check(self) -> None:
        if self._m.is_error():
            raise _refusal(self.compiled.constraint, self._m.get_error())


def allowed_masks(rows: Sequence[RowMatcher], eos_ids: Sequence[int] = ()) -> np.ndarray:
    """(len(rows), vocab_size) bool masks, computed by the engine in parallel when there are several rows."""
    return masks_from_words(rows, fill_words(rows), eos_ids)


def fill_words(rows: Sequence[RowMatcher]) -> np.ndarray:
    """(len(rows), ceil(engine_vocab / 32)) int32: the engine's packed next-token bitmasks of the rows' states, in
    one engine call (its thread pool when there are several rows; the call releases the GIL). The rows may come
    from different constraints that share one executor and one engine vocabulary (a server step's requests)."""
    compiled = rows[0].compiled
    words = np.full((len(rows), (compiled.engine_vocab + 31) // 32), -1, dtype=np.int32)
    if len(rows) == 1:  # fill_next_token_bitmask's own call, without its checks of the array made above
        rows[0]._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    else:
        _llg_numpy().fill_next_token_bitmask_par(compiled.executor, [(r._m, i) for i, r in enumerate(rows)], words)
    return words


def masks_from_words(rows: Sequence[RowMatcher], words: np.ndarray, eos_ids: Sequence[int] = ()) -> np.ndarray:
    """fill_words' bitmasks of rows of ONE constraint -> (len(rows), vocab_size) bool: the engine's end tokens
    dropped, the call's end tokens allowed where a row's text is complete. Raises a row's engine error (a lexer or
    parser limit hit while computing its mask) as a ConstraintError."""
    compiled = rows[0].compiled
    V, w = compiled.vocab_size, min(compiled.vocab_size, compiled.engine_vocab)
    # unpacked straight to (R, w) 0/1 bytes, viewed as bool; ids past the tokenizer's vocabulary stay disallowed
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=w, bitorder="little").view(bool)
    if w < V:
        bits = np.concatenate([bits, np.zeros((len(rows), V - w), dtype=bool)], axis=1)
    for r in rows:
        r.check()
    # a column at a time: one or two end tokens, and fancy indexing costs more than the rest of this function
    ends = {int(t) for t in eos_ids if t < V}
    for t in compiled.engine_eos:
        if t < V and t not in ends:
            bits[:, t] = False  # the engine's end token is the call's to allow
    if ends:
        accepts = [r.accepts_eos for r in rows]
        for t in ends:
            bits[:, t] = accepts
    return bits


def compile_constraint(
    c: Constraint, tokenizer: TextTokenizer, vocab_size: int, eos: Sequence[int]
) -> CompiledConstraint:
    """Compile (or take from the cache) `c` for this tokenizer; refuse in one line what the engine refuses, and
    a language with no sentence at all."""
    llg = _llg()
    digest, lt = engine_tokenizer(tokenizer, eos)
    key = (c.kind, c.text, digest, int(vocab_size))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            _counts["hits"] += 1
            return hit
        _counts["misses"] += 1
    t0 = time.perf_counter()
    try:  # the engine raises plain ValueErrors/Exceptions on some grammars: one line, never a traceback
        template = llg.LLMatcher(lt, _grammar(llg, c), log_level=0, limits=limits())
    except ConstraintError:
        raise
    except Exception as e:
        raise _refusal(c, first_line(e)) from None
    if template.is_error():
        raise _refusal(c, template.get_error())
    compiled = CompiledConstraint(
        c, template, int(vocab_size), tuple(lt.eos_tokens), int(lt.vocab_size), executor=_shared_executor(llg)
    )
    probe = compiled.matcher()
    try:  # the first step's mask: an empty language shows here
        first = probe.allowed(compiled.engine_eos)
    except ConstraintError as e:
        raise ConstraintError(f"The {c.kind} constraint's language is empty (no text satisfies it): {e}") from None
    if not first.any() and not probe.accepts_eos:
        raise ConstraintError(f"The {c.kind} constraint's language is empty: no text satisfies it.")
    compiled.compile_ms = (time.perf_counter() - t0) * 1e3
    with _lock:
        _cache[key] = compiled
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return compiled


def cache_info() -> dict[str, int]:
    with _lock:
        return {"size": len(_cache), "max": CACHE_SIZE, **_counts}


def compile_for(generator: Any, constraint: object) -> CompiledConstraint | None:
    """A Generator call's constraint compiled for its folder's tokenizer and vocabulary, or None."""
    constraint = as_constraint(constraint)
    if constraint is None:
        return None
    return compile_constraint(constraint, generator.tokenizer, generator.graph.vocab_size, generator.eos_token_id)
