"""The swap that installs a finished folder over an old one, safe against signals, and its recovery.

Replacing OUT takes three renames: OUT aside into a marked folder (.OUT.old-...), the new folder in, the marked
folder to a discard name (.OUT.del-...). Between the first two OUT does not exist, so SIGINT, SIGTERM, SIGHUP and
SIGQUIT are held back over the three (`signals_deferred`): they are delivered, and act, once the swap is done.
Only SIGKILL or a power loss can still stop it half-way; then the next write into the same parent puts the
aside folder back (`restore_stale`) instead of deleting it. A .del- folder is discarded; an .old- one never is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

# what a user or a service manager sends to stop a process; SIGKILL cannot be held back
_HELD = tuple(getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, s))


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold back the stopping signals for the block: a signal sent meanwhile is delivered right after it."""
    if hasattr(signal, "pthread_sigmask"):  # POSIX: the kernel keeps them pending
        before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a pending signal acts here
        return
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    got: list[int] = []
    previous = {s: signal.signal(s, lambda n, _f: got.append(n)) for s in _HELD if s == signal.SIGINT}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if got:
            raise KeyboardInterrupt


def discard_name(old: Path) -> Path:
    """.OUT.old-TAIL -> .OUT.del-TAIL: the same owner, marked as safe to delete."""
    i = old.name.rfind(".old-")
    return old.with_name(old.name[:i] + ".del-" + old.name[i + len(".old-") :])


def restore_one(old: Path) -> Path | None:
    """Put the folder inside a dead writer's .NAME.old-... back at NAME when NAME is missing; returns where, or
    None when it stays (NAME exists again, or the content is not one folder)."""
    from gpt2edge.folder import rename_noreplace

    try:
        children = list(old.iterdir())
    except OSError:
        return None
    if len(children) != 1:
        return None
    child = children[0]
    # an aside folder holds OUT under its own name; one of gpt2edge <= 0.x under "x", the name in the prefix
    name = child.name
    if name == "x":
        stem = old.name[1 : old.name.rfind(".old-")]
        name = stem if len(stem) < 100 else ""  # the prefix cuts names at 100 characters: not safe to guess
    if not name:
        return None
    dest = old.parent / name
    try:
        rename_noreplace(child, dest)
    except OSError:  # NAME exists again: both are kept, nothing is deleted
        return None
    with contextlib.suppress(OSError):
        old.rmdir()
    return dest
