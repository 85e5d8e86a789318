"""Constraint: what the generated text must be (a JSON Schema, any JSON object, a regex, one of some strings, a
Lark grammar or a llama.cpp GBNF grammar), as a typed record checked against input limits before any engine runs.

The limits bound what a caller can hand the engine: the text's size, its nesting depth, the number of choices.
They are checked here in linear time, without recursion, so a 10 MB or 10,000-deep schema is refused in one line
before json.loads or the grammar compiler sees it. The engine's own limits (llguidance's LLParserLimits: lexer
fuel, lexer states, grammar size) bound what is left (engine.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpt2edge.errors import GenerationError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
MAX_TEXT_BYTES = 256 * 1024  # a schema or grammar this long is a hand-written one's 100x
MAX_DEPTH = 100  # brackets / parentheses nested deeper than this are not a real schema or grammar
MAX_CHOICES = 4096


class ConstraintError(GenerationError):
    """A constraint that cannot be used: malformed, unsupported by the engine, over a limit, or unsatisfiable."""


def _depth(text: str, json_text: bool) -> int:
    """The deepest bracket nesting, ignoring brackets inside JSON strings (json_text) or escaped by a backslash."""
    depth = best = 0
    in_string = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif json_text and ch == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif ch in "[{(":
            depth += 1
            best = max(best, depth)
        elif ch in "]})":
            depth = max(0, depth - 1)
    return best


def _check_text(kind: str, text: str) -> str:
    """One-line refusals for text that is not text, too long or too deep (before any parser)."""
    if not isinstance(text, str):
        raise ConstraintError(f"A {kind} constraint takes a string, got {type(text).__name__}.")
    if not text.strip():
        raise ConstraintError(f"The {kind} constraint is empty.")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise ConstraintError(
            f"The {kind} constraint is {size:,} bytes; the limit is {MAX_TEXT_BYTES:,} (gpt2edge.runtime.constraints."
            "spec.MAX_TEXT_BYTES)."
        )
    depth = _depth(text, kind in ("json_schema", "choice"))  # choices are JSON text: brackets in strings are not depth
    if depth > MAX_DEPTH:
        raise ConstraintError(f"The {kind} constraint nests {depth} levels deep; the limit is {MAX_DEPTH}.")
    return text


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; text: the schema (JSON text), regex, grammar, or the choices as a JSON list.

    Build one with the class methods (Constraint.json_schema({...}), Constraint.regex(r"..."), ...); the text
    is checked against the input limits at construction. Output must match the whole text: a regex is
    anchored at both ends, a JSON value is the whole output (no text before or after it).
    """

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"Unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}.")
        _check_text(self.kind, self.text)
        if self.kind == "json_schema":
            _parse_schema(self.text)

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> Constraint:
        """A JSON Schema, as a dict or JSON text; keywords the engine does not implement are refused by name."""
        if isinstance(schema, dict):
            try:
                schema = json.dumps(schema)
            except (TypeError, ValueError, RecursionError) as e:
                raise ConstraintError(f"The JSON Schema is not JSON-serialisable: {str(e)[:200]}.") from None
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls("json_object", '{"type": "object"}')

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """The whole output matches `pattern` (Rust regex syntax, as llguidance reads it)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """The output is exactly one of `options` (non-empty strings)."""
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise ConstraintError("A choice constraint takes a list of strings.")
        options = list(options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError("A choice constraint takes a non-empty list of non-empty strings.")
        if len(options) > MAX_CHOICES:
            raise ConstraintError(f"A choice constraint has {len(options)} options; the limit is {MAX_CHOICES}.")
        return cls("choice", json.dumps(options, ensure_ascii=False))

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """A Lark grammar (llguidance's dialect; `start` is the top rule)."""
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> Constraint:
        """A llama.cpp GBNF grammar (`root` is the top rule); converted to Lark by llguidance."""
        return cls("gbnf", grammar)

    @classmethod
    def grammar(cls, text: str, name: str = "") -> Constraint:
        """A grammar file's text, GBNF or Lark: by extension (.gbnf, .lark), else by content (GBNF rules use
        `::=`, Lark's `:`)."""
        lower = name.lower()
        if lower.endswith(".gbnf"):
            return cls.gbnf(text)
        if lower.endswith(".lark"):
            return cls.lark(text)
        return cls.gbnf(text) if "::=" in text else cls.lark(text)

    @property
    def choices(self) -> list[str] | None:
        return json.loads(self.text) if self.kind == "choice" else None

    def describe(self) -> str:
        """A short label for errors and results, e.g. "regex '[0-9]+'"."""
        short = self.text if len(self.text) <= 40 else self.text[:37] + "..."
        return f"{self.kind} {short!r}"


def _parse_schema(text: str) -> Any:
    """The schema as JSON (depth already bounded); one line naming where it is not JSON or not a schema."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(
            f"The JSON Schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}."
        ) from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"A JSON Schema is an object (or true/false), got {type(schema).__name__}.")
    return schema


def as_constraint(value: object) -> Constraint | None:
    """A call's `constraint=` argument: None or a Constraint; anything else is refused in one line."""
    if value is None or isinstance(value, Constraint):
        return value
    raise ConstraintError(
        f"constraint must be a gpt2edge.runtime.constraints.Constraint (e.g. Constraint.regex(...)), got "
        f"{type(value).__name__}."
    )
