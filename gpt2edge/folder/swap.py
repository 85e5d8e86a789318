"""The swap that installs a finished folder over an old one, safe against signals, and its recovery.

Replacing OUT takes three renames: OUT aside into a marked folder (.OUT.old-...), the new folder in, the marked
folder to a discard name (.OUT.del-...). Between the first two OUT does not exist, so SIGINT, SIGTERM, SIGHUP and
SIGQUIT are held back over the three (`signals_deferred`): they are delivered, and act, once the swap is done.
Only SIGKILL or a power loss can still stop it half-way; then the next write into the same parent puts the
aside folder back (`restore_one`, through gpt2edge.folder.temp) instead of deleting it. A .del- folder is
discarded; an .old- one never is. `rename_noreplace` is the rename that never replaces what is at its target.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
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


def _renameat2() -> Callable | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None  # glibc < 2.28, musl without it
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename folder src to dst, raising FileExistsError if dst exists (os.rename would replace an empty one)."""
    fn = _renameat2()
    if fn is not None:
        AT_FDCWD, RENAME_NOREPLACE = -100, 1
        if fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
    if os.name == "nt":
        os.rename(src, dst)  # Windows never replaces
        return
    # no renameat2 (or a file system without it): claim the name with mkdir, which fails if anything is there,
    # then rename onto that empty folder of ours
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.rmdir(dst)
        if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from e
        raise


def discard_name(old: Path) -> Path:
    """.OUT.old-TAIL -> .OUT.del-TAIL: the same owner, marked as safe to delete."""
    i = old.name.rfind(".old-")
    return old.with_name(old.name[:i] + ".del-" + old.name[i + len(".old-") :])


def restore_one(old: Path) -> Path | None:
    """Put the folder inside a dead writer's .NAME.old-... back at NAME when NAME is missing; returns where, or
    None when it stays (NAME exists again, or the content is not one folder)."""
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
