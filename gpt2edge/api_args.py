"""Type checks of the public Python API's arguments: a wrong type raises ArgumentTypeError (a TypeError) that
names the argument, what it got and what it takes, before anything is tokenized or loaded.

Without them `generate(None)` failed deep inside as "'NoneType' object is not iterable", `generate(['a', 5])` as
"'int' object has no attribute 'encode'", and `stop=b"x"` as a complaint about the integer 120.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpt2edge.errors import ArgumentTypeError


def _what(value: Any) -> str:
    """How a wrong value is named in a message: its type, and a short repr."""
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def text_arg(value: Any, name: str) -> str:
    """A str; bytes get the hint to decode them."""
    if isinstance(value, str):
        return value
    hint = " (decode bytes first: value.decode('utf-8'))" if isinstance(value, (bytes, bytearray)) else ""
    raise ArgumentTypeError(f"{name} must be a str, got {_what(value)}{hint}.")


def prompts_arg(prompt: Any) -> tuple[list[str], bool]:
    """generate()'s prompt: a str (one prompt) or a list/tuple of str (a batch). Returns (prompts, single)."""
    if isinstance(prompt, str):
        return [prompt], True
    if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
        raise ArgumentTypeError(
            f"prompt must be a str or a list of str, got {_what(prompt)}"
            + (" (decode bytes first: value.decode('utf-8'))." if isinstance(prompt, (bytes, bytearray)) else ".")
        )
    prompts = list(prompt)
    for i, p in enumerate(prompts):
        text_arg(p, f"prompt[{i}]")
    return prompts, False


def strings_arg(value: Any, name: str) -> tuple[str, ...]:
    """stop / ban: None, one str, or a list/tuple of str (a plain str is one entry, not one per character)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ArgumentTypeError(f"{name} must be a str or a list of str, got {_what(value)}.")
    return tuple(text_arg(s, f"each of {name}") for s in value)


def path_arg(value: Any, name: str) -> Path:
    """A folder argument: a str or an os.PathLike (pathlib.Path)."""
    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise ArgumentTypeError(f"{name} must be a path (str or pathlib.Path), got {_what(value)}.")


def int_arg(value: Any, name: str, optional: bool = True) -> int | None:
    """An int (not a bool, not a float), or None where optional."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy integers are Integral
        raise ArgumentTypeError(f"{name} must be an int{' or None' if optional else ''}, got {_what(value)}.")
    return int(value)
