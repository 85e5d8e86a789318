"""Typed reads of manifest.json's fields: each checked for type and range, or one ModelFolderError that names it.

JSON hands over bools where numbers are expected (and a bool is an int in Python), strings for numbers, nulls
and lists anywhere; every field is checked once here, at load, so that none surfaces later as a traceback or as
a wrong figure. Imports nothing above gpt2edge.errors (the runtime uses it on the device).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from gpt2edge.errors import ModelFolderError

REQUIRED: Any = object()  # the default of a field that must be present
_SHA256 = re.compile(r"[0-9a-f]{64}")
PATH_MAX = 4096  # Linux's longest path: the paths and hub ids the records name (printed, or opened) are shorter


def _shown(value: Any, limit: int = 40) -> str:
    """A value as the error shows it: short, on one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_path(rel: Any, limit: int = 80, quoted: bool = False) -> str:
    """A path a manifest names, as an error names it: as it is when short and printable (quoted: its repr),
    else its repr cut short (a hostile manifest may name a path of megabytes, or one with a newline)."""
    if not quoted and isinstance(rel, str) and len(rel) <= limit and rel.isprintable():
        return rel
    return _shown(rel, limit)


class Fields:
    """One JSON object of a manifest, read field by field. `name` is its path in the manifest ("graph",
    "graph.static", "" for the top level); `fix` ends every error ("re-export the model")."""

    def __init__(self, data: Any, name: str, where: str, fix: str = "re-export the model") -> None:
        self.name, self.where, self.fix = name, where, fix
        if not isinstance(data, dict):
            raise ModelFolderError(f"{where}: {name} must be an object, got {_shown(data)}; {fix}.")
        self.data = data

    def path(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def fail(self, key: str, must: str, value: Any) -> NoReturn:
        raise ModelFolderError(f"{self.where}: {self.path(key)} must be {must}, got {_shown(value)}; {self.fix}.")

    def _get(self, key: str, default: Any, must: str) -> tuple[Any, bool]:
        """(value, whether it was absent); a required field that is absent fails here."""
        if key in self.data:
            return self.data[key], False
        if default is REQUIRED:
            raise ModelFolderError(f"{self.where}: {self.path(key)} is missing (it must be {must}); {self.fix}.")
        return default, True

    def integer(
        self, key: str, default: Any = REQUIRED, *, min: int = 1, max: int | None = None, nullable: bool = False
    ) -> Any:
        """An int (never a bool) in min..max."""
        must = "a positive integer" if (min, max) == (1, None) else f"an integer >= {min}"
        if max is not None:
            must = f"an integer from {min} to {max}"
        v, absent = self._get(key, default, must)
        if absent or (v is None and nullable):
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < min or (max is not None and v > max):
            self.fail(key, must, v)
        return v

    def number(self, key: str, default: Any = REQUIRED) -> Any:
        """A finite number > 0 (an int or a float, never a bool), as a float."""
        v, absent = self._get(key, default, "a positive number")
        if absent:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            self.fail(key, "a positive number", v)
        return float(v)

    def text(
        self,
        key: str,
        default: Any = REQUIRED,
        *,
        choices: Sequence[str] = (),
        nullable: bool = False,
        max_len: int | None = None,
    ) -> Any:
        """A non-empty string (of at most max_len characters), one of `choices` when given."""
        must = f"one of {', '.join(map(repr, choices))}" if choices else "a non-empty string"
        if max_len is not None:
            must += f" of at most {max_len} characters"
        v, absent = self._get(key, default, must)
        if absent or (v is None and nullable):
            return v
        if not isinstance(v, str) or not v or (choices and v not in choices) or (max_len and len(v) > max_len):
            self.fail(key, must, v)
        return v

    def flag(self, key: str, default: Any = REQUIRED) -> Any:
        v, absent = self._get(key, default, "true or false")
        if not absent and type(v) is not bool:
            self.fail(key, "true or false", v)
        return v

    def items(self, key: str, default: Any = REQUIRED) -> Any:
        v, absent = self._get(key, default, "a list")
        if not absent and not isinstance(v, list):
            self.fail(key, "a list", v)
        return v

    def record(self, key: str, default: Any = REQUIRED, *, nullable: bool = False) -> Fields | None:
        """A nested object as Fields; None when absent with default None (or null and nullable)."""
        v, absent = self._get(key, default, "an object")
        if (absent and v is None) or (v is None and nullable):
            return None
        return Fields(v, self.path(key), self.where, self.fix)


def read_digest(entry: Any, rel: str, where: str) -> tuple[str, int]:
    """(sha256, size) of one entry of 'files': a lowercase hex digest and a byte count >= 0."""
    f = Fields(entry, f"files[{rel!r}]", where)
    sha = f.text("sha256")
    if not _SHA256.fullmatch(sha):
        f.fail("sha256", "a sha256 digest (64 lowercase hex digits)", sha)
    return sha, f.integer("size", min=0)


def check_io(graph: Fields, key: str) -> None:
    """graph.inputs / graph.outputs (read by quantize, trim and convert): a list of {name, dtype, shape}, each
    dimension a size >= 0 or an axis name."""
    for i, entry in enumerate(graph.items(key, [])):
        t = Fields(entry, f"{graph.path(key)}[{i}]", graph.where, graph.fix)
        t.text("name")
        t.text("dtype")
        for j, dim in enumerate(t.items("shape")):
            ok = (isinstance(dim, str) and dim) or (type(dim) is int and dim >= 0)
            if not ok:
                t.fail(f"shape[{j}]", "a size >= 0 or an axis name", dim)


# quantization.recipe.target: the CPU a variant was tuned for (`quantize --target`); it runs on any CPU
QUANTIZE_TARGETS = ("avx2", "avx512-vnni", "amx", "generic", "arm64", "arm64-dotprod", "arm64-i8mm", "arm64-sve")


def check_records(top: Fields) -> None:
    """The records nothing reads typed but some code reads raw: bench --vs-torch takes the source model from
    'source', refusals name the parent of a quantized, converted or trimmed folder."""
    top.text("gpt2edge_version", None)
    top.text("created", None)
    top.record("versions", None)
    top.record("validation", None, nullable=True)  # null: exported with --no-validate
    top.record("quality", None, nullable=True)
    source = top.record("source", None)
    if source is not None:
        for key in ("model", "path", "kind", "revision", "commit_hash", "tokenizer", "transformers"):
            source.text(key, None, nullable=True, max_len=PATH_MAX)
    for key in ("quantization", "conversion", "trim"):
        rec = top.record(key, None)
        parent = rec.record("parent", None) if rec is not None else None
        if parent is not None:
            parent.text("path", None, max_len=PATH_MAX)
        recipe = rec.record("recipe", None) if key == "quantization" and rec is not None else None
        if recipe is not None:
            recipe.text("target", None, choices=QUANTIZE_TARGETS, nullable=True)  # absent before --target
            recipe.flag("kleidiai", None)  # false: sessions keep ONNX Runtime's KleidiAI kernels off (docs/arm.md)
