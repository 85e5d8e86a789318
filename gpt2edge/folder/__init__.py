"""Atomic model folders: built in a temporary sibling, renamed into place only when complete.

The rules every command that writes a folder (export, quantize, random-checkpoint) follows:
- OUT is checked before any work (gpt2edge.folder.checks): not the input, not inside it, not holding it; not the
  current folder or one of its parents; an existing OUT needs --force, and --force replaces only a folder of the
  expected kind.
- The final step never replaces what --force did not authorise at that moment: without --force the rename
  fails if OUT appeared meanwhile; with --force what is there is checked again right before it is replaced.
- Every file and folder written gets the mode a plain open() / mkdir() would give under the umask.
- Temporary folders carry their owner's pid; ones whose process is gone (SIGKILL, power loss) are removed
  by the next write into the same parent (gpt2edge.folder.temp), except a replaced OUT moved aside, which is
  put back (gpt2edge.folder.swap).
- Replacing OUT is signal-safe: the renames run with the stopping signals held back (gpt2edge.folder.swap).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from gpt2edge.errors import Gpt2EdgeError, OutputExistsError, OutputFolderError
from gpt2edge.folder.checks import DISK_FULL, check_output_dir, disk_full, is_export_folder, replaceable, write_error
from gpt2edge.folder.swap import discard_name, rename_noreplace, signals_deferred
from gpt2edge.folder.temp import clean_stale, make_temp
from gpt2edge.manifest import current_umask


def _restore(old: Path, out: Path) -> Path:
    """Put a folder moved aside back at `out`, or beside it when something took its place; returns where."""
    for dest in (out, out.with_name(f"{out.name}.replaced-{os.getpid()}")):
        try:
            rename_noreplace(old / out.name, dest)
        except OSError:
            continue
        old.rmdir()
        return dest
    return old / out.name


def _install(tmp: Path, out: Path, shown: Path, force: bool, kind: Callable[[Path], bool]) -> None:
    """Move the finished folder to `out`, replacing only what --force authorises now.

    The renames run with SIGINT/SIGTERM/SIGHUP/SIGQUIT held back (gpt2edge.folder.swap): a signal can no longer
    land between moving OUT aside and moving the new folder in, and it acts once the swap is complete."""
    appeared = (
        f"Output folder {shown} appeared while gpt2edge was writing; it was left untouched and nothing was written"
    )
    old = gone = None
    try:
        with signals_deferred():
            if force and (out.exists() or out.is_symlink()):
                if not replaceable(out, kind):
                    raise OutputExistsError(appeared + " (it is not a gpt2edge folder, which --force may replace).")
                old = make_temp(out.parent, out.name, "old")
                try:
                    # moved aside under its own name into a marked folder: a SIGKILL from here on leaves it restorable
                    os.rename(out, old / out.name)
                except FileNotFoundError:  # removed meanwhile: nothing to replace
                    old.rmdir()
                    old = None
                if old is not None and not replaceable(old / out.name, kind):  # changed since the check: put it back
                    where = _restore(old, out)
                    raise OutputExistsError(appeared + ("." if where == out else f"; it is now at {where}."))
            try:
                rename_noreplace(tmp, out)
            except OSError as e:
                where = _restore(old, out) if old is not None else None
                if not isinstance(e, FileExistsError):
                    raise
                hint = f" The folder it was to replace is at {where}." if where else " Pass --force to replace it."
                raise OutputExistsError(appeared + "." + hint) from None
            if old is not None:
                # replaced for good: from now on a stale copy is deleted, not restored (if this rename fails, the
                # .old- folder stays: left alone, as OUT exists)
                with contextlib.suppress(OSError):
                    os.rename(old, discard_name(old))
                    gone = discard_name(old)
    finally:  # also when a signal held back over the swap raises KeyboardInterrupt as it ends
        if gone is not None:
            shutil.rmtree(gone, ignore_errors=True)


def usual_modes(folder: Path) -> None:
    """Give every file and folder inside `folder` the mode a plain open() / mkdir() gives under the umask: some
    writers make private files (onnx's external data, safetensors: 0600), and copy2 keeps a source file's mode."""
    mask = current_umask()
    for root, dirs, files in os.walk(folder):
        for name, mode in [*((d, 0o777) for d in dirs), *((f, 0o666) for f in files)]:
            path = os.path.join(root, name)
            if not os.path.islink(path):  # chmod would follow it out of the folder
                os.chmod(path, mode & ~mask)


@contextlib.contextmanager
def atomic_output_dir(
    out: Path,
    force: bool = False,
    sources: Iterable[str | Path | None] = (),
    kind: Callable[[Path], bool] = is_export_folder,
) -> Iterator[Path]:
    """Yield a temporary folder next to `out`; on success it becomes `out`, on any failure it is removed.

    The temp folder sits in the same parent so the final rename never crosses a file system.
    KeyboardInterrupt is a BaseException and is caught too: Ctrl-C leaves nothing behind.
    """
    shown = Path(out)
    sources = list(sources)
    real = check_output_dir(shown, force, sources, kind)
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(real.parent)
        tmp = make_temp(real.parent, real.name, "tmp")
        tmp.chmod(0o777 & ~current_umask())  # a private (0700) folder until now; the result gets the usual permissions
    except OSError as e:
        raise write_error(e, shown) from e
    try:
        yield tmp
        usual_modes(tmp)
        try:
            _install(tmp, real, shown, force, kind)
        except OSError as e:  # e.g. OUT is a mount point
            raise OutputFolderError(
                f"Cannot move the result to {shown} ({e.strerror or e}); nothing was replaced."
            ) from e
    except BaseException as e:
        # asked before the partial files are removed: removing them frees the space a C++ writer ran out of
        full = isinstance(e, Exception) and not isinstance(e, Gpt2EdgeError) and disk_full(real.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            raise write_error(e, shown) from e
        if full:
            raise write_error(OSError(errno.ENOSPC, "disk full"), shown) from e
        raise
