"""One rule for every path option of every command: an input never lies in what the command writes.

A command's outputs are the parameters typed `OutputPath` (export/quantize/... OUT, bench --plot); every other
`click.Path` parameter is an input (model folders, texts, id lists, corpora, drafts, tokenizers). An input that
is an output or lies inside one is refused before any work, with or without --force: replacing OUT would
delete it. The library keeps its own checks (gpt2edge.folder.checks) for Python callers; this guard covers
every option of every command, including ones added later, because it reads the command's own parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click

from gpt2edge.folder.checks import check_inputs


class OutputPath(click.Path):
    """The type of a parameter the command writes (a folder or a file)."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("path_type", Path)
        super().__init__(**kwargs)


def _shown(param: click.Parameter) -> str:
    if isinstance(param, click.Option):
        return max(param.opts, key=len)  # the long spelling: --keep-ids
    return (param.name or "?").upper()


def _values(param: click.Parameter, value) -> Iterator[str | Path]:
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if not isinstance(v, (str, Path)):
            v = getattr(v, "name", None)  # a click.File: the path it was opened from
        if isinstance(v, (str, Path)) and str(v) not in ("", "-"):
            yield v


def check_command_paths(ctx: click.Context | None) -> None:
    """Refuse an input path option that is, or lies inside, an output of the same command."""
    if ctx is None:
        return
    params = [p for p in ctx.command.params if p.name in ctx.params and ctx.params[p.name] is not None]
    outputs = [(p, v) for p in params if isinstance(p.type, OutputPath) for v in _values(p, ctx.params[p.name])]
    inputs = [
        (p, v)
        for p in params
        if isinstance(p.type, (click.Path, click.File)) and not isinstance(p.type, OutputPath)
        for v in _values(p, ctx.params[p.name])
    ]
    for _, out in outputs:
        check_inputs(Path(out), [(f"{_shown(p)} {v}", Path(v)) for p, v in inputs])
