"""Helpers shared by the test rooms (fixtures live in tests/conftest.py): the repository root, the CLI run in
process or a Python child process, and the check that a refusal is one `error:` line. Room helpers: serve,
speculative, sparse_cases, web_helpers, docs_markdown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner, Result

REPO = Path(__file__).resolve().parents[2]


def cli(*args: object, input: str | bytes | None = None) -> Result:
    """`gpt2edge ARGS...` in this process (click's runner; stderr is in .output)."""
    from gpt2edge.cli import main  # here, not at import: the torch-free lanes import this package too

    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def python_child(*args: str) -> subprocess.Popen:
    """`python ARGS...` in a child process that imports this checkout, stdout and stderr piped as text (a server
    started by the CLI, whose lines the test reads before it stops it)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def one_error_line(r: Result, *phrases: str) -> str:
    """Exit status 1, no traceback, and the output one `error:` line holding each of `phrases`; returns it."""
    assert r.exit_code == 1, (r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output[-2000:]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]
