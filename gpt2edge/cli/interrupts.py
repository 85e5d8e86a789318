"""Ctrl-C and a closed stdout, for every command: exit 130 with `[interrupted]`, never a traceback.

Start-up (importing onnxruntime, numpy, click and the command's modules takes up to seconds) used to show
a KeyboardInterrupt traceback, or an ImportError when the interrupt left a module half imported and a later
import tripped on it. So, before anything heavy is imported:

- guard_startup(): until a command starts its work, Ctrl-C prints `[interrupted]` and exits 130 at once
  (nothing has been written yet: there is nothing to clean up). Only in the `gpt2edge` process itself: the
  interpreter's own start (site, ~60 ms) comes before any gpt2edge code and keeps Python's handling.
- arm(): when the command starts, Ctrl-C raises KeyboardInterrupt again (commands stop cleanly: generate
  prints what it has, folder writes remove their temporary folder) and is remembered, so that whatever
  exception it turns into on the way out (an ImportError of a half-imported module, click's Abort) ends as
  `[interrupted]` with status 130.
Kept free of heavy imports: it runs first.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
_seen = False


def _say_interrupted() -> None:
    try:
        os.write(2, b"[interrupted]\n")
    except OSError:  # stderr closed: the status says it
        pass


def _exit_now(signum, frame) -> None:
    # os._exit, not SystemExit: an exception raised inside a C extension's initialisation comes out as
    # "ImportError: initialization failed"; before the command starts nothing is written or buffered
    _say_interrupted()
    os._exit(INTERRUPTED)


def _raise_interrupt(signum, frame) -> None:
    global _seen
    _seen = True
    raise KeyboardInterrupt


def _running_as_command() -> bool:
    """The `gpt2edge` script, or `python -m gpt2edge.cli` (argv[0] is "-m" while runpy imports the package);
    not a program or test that imports gpt2edge.cli, whose Ctrl-C handling is its own."""
    return os.path.basename(sys.argv[0]) == "gpt2edge" or sys.argv[0] == "-m"


def guard_startup() -> None:
    """Ctrl-C during start-up: `[interrupted]`, status 130. Left alone where SIGINT is ignored (nohup, `&`)."""
    if _running_as_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_now)


def arm() -> None:
    """From here on Ctrl-C raises KeyboardInterrupt (see the module docstring)."""
    if signal.getsignal(signal.SIGINT) is _exit_now:
        signal.signal(signal.SIGINT, _raise_interrupt)


def interrupted() -> bool:
    """Whether Ctrl-C arrived since arm()."""
    return _seen


def exit_interrupted() -> None:
    _say_interrupted()
    sys.exit(INTERRUPTED)


def check_stdout() -> None:
    """A command started with stdout closed (`>&-`): Python sets sys.stdout to None and click's echo drops
    everything silently, so the command would "succeed" with its output lost. Refuse, status 1."""
    if sys.stdout is None:
        try:
            os.write(2, b"error: stdout is closed; redirect it to a file or to /dev/null instead of closing it.\n")
        except OSError:
            pass
        sys.exit(1)
