"""A request's structured-output fields -> one runtime Constraint, checked and compiled at admission.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), llama-server's `json_schema` and
`grammar` (GBNF), vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (GBNF or Lark). At most
one per request; what the engine refuses (a bad schema, an unsupported keyword, a regex that does not compile, a
limit) is a 400 with the engine's reason, before the request takes a row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpt2edge.errors import MissingExtraError
from gpt2edge.runtime.constraints.engine import first_line
from gpt2edge.runtime.constraints.spec import Constraint, ConstraintError
from gpt2edge.serve.api.protocol import ApiError

FIELDS = ("response_format", "json_schema", "grammar", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar")  # fmt: skip


def _response_format(value: dict[str, Any]) -> Constraint | None:
    """OpenAI's response_format (and llama-server's {"type": "json_object", "schema": {...}})."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        return Constraint.json_object() if schema is None else Constraint.json_schema(_schema(schema))
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.')
        if not isinstance(spec.get("strict", False), bool):
            raise ConstraintError("response_format.json_schema.strict must be a boolean.")
        return Constraint.json_schema(_schema(spec["schema"]))
    raise ConstraintError(f"response_format.type must be text, json_object or json_schema, got {kind!r}.")


def _schema(value: Any) -> dict[str, Any] | str:
    if not isinstance(value, (dict, str, bool)):
        raise ConstraintError(f"A JSON Schema is an object, got {type(value).__name__}.")
    return value if not isinstance(value, bool) else ("true" if value else "false")


def _build(name: str, value: Any) -> Constraint | None:
    if name == "response_format":
        return _response_format(value)
    if name in ("json_schema", "guided_json"):
        return Constraint.json_schema(_schema(value))
    if name == "grammar":
        return Constraint.gbnf(value)
    if name == "guided_regex":
        return Constraint.regex(value)
    if name == "guided_choice":
        return Constraint.choice(value)
    return Constraint.grammar(value)  # guided_grammar: GBNF (`::=` rules) or Lark


def constraint_from(req: Any, compile: Callable[[Constraint], Any] | None) -> tuple[Constraint | None, Any]:
    """(the Constraint, its compiled form) of the request's one structured-output field, or (None, None).
    compile: the scheduler's compiler for this model (None: this server cannot constrain)."""
    given = [name for name in FIELDS if getattr(req, name) is not None]  # every request has them (SamplingFields)
    if len(given) > 1:
        raise ApiError(400, f"{given[0]} and {given[1]} both constrain the output; send at most one of "
                       f"{', '.join(FIELDS)}.", given[1], "invalid_value")  # fmt: skip
    if not given:
        return None, None
    name = given[0]
    try:
        constraint = _build(name, getattr(req, name))
        if constraint is None:
            return None, None
        if compile is None:
            raise ConstraintError("This server's scheduler cannot apply a constraint.")
        # compiled here, on the request's thread: a bad grammar is refused before the request takes a row
        return constraint, compile(constraint)
    except MissingExtraError as e:
        raise ApiError(400, str(e), name, "unsupported") from None
    except ConstraintError as e:
        raise ApiError(400, f"{name}: {e}", name, "invalid_constraint") from None
    except Exception as e:  # anything else the engine raises on this text is still the request's fault
        raise ApiError(400, f"{name}: the engine refuses it: {first_line(e)}", name, "invalid_constraint") from None
