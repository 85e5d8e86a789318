"""What every command shares: the group, one-line errors, JSON output, warnings on stderr, option ranges."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import sys
import warnings

import click

from gpt2edge import __version__
from gpt2edge.cli.interrupts import arm, check_stdout, exit_interrupted, interrupted
from gpt2edge.cli.paths import check_command_paths
from gpt2edge.errors import ChecksumError, Gpt2EdgeError
from gpt2edge.runtime.model.ort_session import MAX_THREADS, PROVIDERS


def friendly_errors(fn):
    """Turn gpt2edge's typed errors into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            check_command_paths(click.get_current_context(silent=True))  # an input inside OUT: refused first
            return fn(*args, **kwargs)
        except Gpt2EdgeError as e:
            click.echo(f"error: {e}{_skip_hint(e)}", err=True)
            sys.exit(1)
        except OSError as e:  # what the OS refused and no check foresaw (e.g. a file name over 255 bytes)
            click.echo(f"error: {_os_error(e)}", err=True)
            sys.exit(1)
        except MemoryError as e:  # e.g. numpy cannot allocate the KV cache of 10^7 beams
            click.echo(
                f"error: out of memory ({e or 'allocation failed'}); ask for less (fewer prompts, beams or samples, "
                "a smaller -n), or free memory.",
                err=True,
            )
            sys.exit(1)

    return wrapper


def _os_error(e: OSError) -> str:
    """One line: the OS's reason and the file(s) it names, each cut short (a name may be kilobytes long)."""
    names = [n for n in (e.filename, e.filename2) if n is not None]
    shown = [r if len(r := repr(str(n))) <= 80 else r[:77] + "..." for n in names]
    return f"{e.strerror or e}: {' -> '.join(shown)}" if shown else str(e.strerror or e)


FULL_VERIFY_HELP = "Hash every model file, even when a record of an earlier full check matches (docs/safety.md)."


def verify_mode(no_verify: bool, full_verify: bool) -> bool | str:
    """ModelFolder.open's verify= for --no-verify / --verify: presence only, every byte, or the fast record check."""
    if no_verify and full_verify:
        raise click.UsageError("--verify and --no-verify contradict each other; pass one.")
    return False if no_verify else ("full" if full_verify else True)


def _skip_hint(e: Gpt2EdgeError) -> str:
    """A checksum error names --no-verify only in a command that has it (the library's message names no flag)."""
    ctx = click.get_current_context(silent=True)
    has_flag = ctx is not None and any(p.name == "no_verify" for p in ctx.command.params)
    return " Or pass --no-verify to skip the check." if isinstance(e, ChecksumError) and has_flag else ""


def print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def report_stream(as_json: bool):
    """Where a human report (validation table, quality report) goes: stdout, or stderr under --json, whose
    stdout is exactly one JSON document. Progress bars (on a terminal only) and errors go to stderr."""
    return sys.stderr if as_json else sys.stdout


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf: nan passes every comparison, so a plain range lets it in."""

    name = "float"  # the metavar: FLOAT, as for a plain float option

    def _describe_range(self) -> str:
        # click writes an unbounded side as "x<=None"; say what is required instead
        return "finite" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def finite_range(
    min: float | None = None, max: float | None = None, min_open: bool = False, max_open: bool = False
) -> FiniteFloatRange:
    """The type of every float option: a range (unbounded where None) of finite numbers."""
    return FiniteFloatRange(min, max, min_open=min_open, max_open=max_open)


DEVICES = click.Choice(tuple(PROVIDERS))  # the execution providers the runtime knows
DEVICE_HELP = "Where ONNX Runtime runs the model: cpu, or cuda (needs onnxruntime-gpu: scripts/setup.sh --gpu)."

# every --threads option: the runtime's own bound (ONNX Runtime would try to start any number of threads)
THREADS = click.IntRange(1, MAX_THREADS)
THREADS_HELP = f"Intra-op threads, 1..{MAX_THREADS} [default: ONNX Runtime's choice]."


SEEDS = click.IntRange(0, 2**63 - 1)


@contextlib.contextmanager
def warnings_to_stderr():
    """Library warnings (e.g. a draft model that is not smaller) as one `warning:` line each on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                click.echo(f"warning: {w.message}", err=True)


# the module that defines each command (it registers the command when imported): a run imports its command's
# module only, so `gpt2edge generate` loads neither the exporter's nor the server's trees (a cold start's imports);
# tests/cli/test_cli_lazy.py checks this table against what the modules register
COMMAND_MODULES = {
    "export": "folders",
    "random-checkpoint": "folders",
    "quantize": "folders",
    "convert": "folders",
    "trim-vocab": "folders",
    "generate": "generate",
    "parity": "measure",
    "bench": "measure",
    "score": "measure",
    "serve": "serve",
    "sparse-head": "sparse",
}


def import_command_module(module: str) -> None:
    importlib.import_module(f"gpt2edge.cli.{module}")


class Gpt2EdgeGroup(click.Group):
    """The command group: Ctrl-C anywhere in a command ends it with `[interrupted]` and status 130 (click's own
    handling says "Aborted!" with status 1), and a closed stdout is refused before any work. A command's module
    is imported when that command runs (COMMAND_MODULES); reading `commands` (help, listings) imports them all."""

    @property
    def commands(self) -> dict[str, click.Command]:
        for module in dict.fromkeys(COMMAND_MODULES.values()):
            import_command_module(module)
        return self._commands

    @commands.setter
    def commands(self, value: dict[str, click.Command]) -> None:
        self._commands = value

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        # a module registering its command as it is imported: straight into the table (reading `commands` here
        # would import every other module)
        self._commands[name or cmd.name] = cmd

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMAND_MODULES:
            import_command_module(COMMAND_MODULES[cmd_name])
        return self._commands.get(cmd_name)

    def invoke(self, ctx: click.Context):
        check_stdout()
        arm()
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            exit_interrupted()
        except Exception:
            if interrupted():  # e.g. an ImportError of a module Ctrl-C left half imported
                exit_interrupted()
            raise


@click.group(cls=Gpt2EdgeGroup)
@click.version_option(__version__, prog_name="gpt2edge")
def main() -> None:
    """Export GPT-2-family models to ONNX, quantize them, and generate text on ONNX Runtime."""
