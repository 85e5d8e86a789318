"""Structured output: constrain generated text to a JSON Schema, any JSON object, a regex, a choice of strings,
a Lark or a GBNF grammar (docs/structured.md). The engine is llguidance, imported only when a constraint is used."""

from gpt2edge.runtime.constraints.engine import (
    CompiledConstraint,
    RowMatcher,
    cache_info,
    compile_constraint,
    compile_for,
)
from gpt2edge.runtime.constraints.spec import KINDS, Constraint, ConstraintError, as_constraint

__all__ = [
    "KINDS", "CompiledConstraint", "Constraint", "ConstraintError", "RowMatcher", "as_constraint", "cache_info",
    "compile_constraint", "compile_for",
]  # fmt: skip
