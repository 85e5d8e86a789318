"""Atomic model folders: built in a temporary sibling, renamed into place only when complete.

The rules every command that writes a folder (export, quantize, random-checkpoint) follows:
- OUT is checked before any work: not the input, not inside it, not holding it; not the current folder or one
  of its parents; an existing OUT needs --force, and --force replaces only a folder of the expected kind.
- The final step never replaces what --force did not authorise at that moment: without --force the rename
  fails if OUT appeared meanwhile; with --force what is there is checked again right before it is replaced.
- Every file and folder written gets the mode a plain open() / mkdir() would give under the umask.
- Temporary folders carry their owner's pid; ones whose process is gone (SIGKILL, power loss) are removed
  by the next write into the same parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from gpt2edge.errors import Gpt2EdgeError, OutputExistsError, OutputFolderError
from gpt2edge.manifest import current_umask
from gpt2edge.manifest_records import FORMAT, MANIFEST_NAME

# .NAME.tmp-HOST-PID-START-RANDOM: HOST tells folders of other machines (or containers) apart, START (the
# process start time) tells a reused pid apart
_TEMP_RE = re.compile(r"^\..*\.(?:tmp|old)-([0-9a-f]{8})-(\d+)-(\d+)-[0-9a-f]+$")
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NO_WRITE = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "not permitted"}


def is_export_folder(path: Path) -> bool:
    """True for a folder that holds a gpt2edge manifest: what `export/quantize --force` may replace."""
    try:
        data = json.loads((Path(path) / MANIFEST_NAME).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def is_checkpoint_folder(path: Path) -> bool:
    """True for a Hugging Face checkpoint folder (config.json + weights): what `random-checkpoint --force` replaces."""
    p = Path(path)
    return (p / "config.json").is_file() and any((p / w).is_file() for w in ("model.safetensors", "pytorch_model.bin"))


def _replaceable(path: Path, kind: Callable[[Path], bool]) -> bool:
    """An empty folder (nothing to lose) or one of the expected kind; never a symlink."""
    try:
        return not path.is_symlink() and path.is_dir() and (not any(path.iterdir()) or kind(path))
    except OSError:
        return False


def _resolve(path: Path, what: str) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # symlink loop, NUL byte
        raise OutputFolderError(f"The {what} path {str(path)!r} cannot be resolved ({e}); choose another path.") from e


def check_sources(out: Path, sources: Iterable[str | Path | None]) -> None:
    """Refuse an OUT equal to, inside, or holding an input (symlinks resolved): --force would delete the input."""
    real = _resolve(out, "output")
    for src in sources:
        if src is None or not Path(src).exists():
            continue  # a hub id, not a local folder
        s = _resolve(Path(src), "input")
        if real == s:
            raise OutputFolderError(f"The output folder is the input folder ({src}); write the output elsewhere.")
        if s in real.parents:
            raise OutputFolderError(f"The output folder {out} is inside the input {src}; choose a path outside it.")
        if real in s.parents:
            raise OutputFolderError(
                f"The output folder {out} holds the input {src}; replacing it would delete the input, choose another."
            )


def check_output_dir(
    out: Path,
    force: bool,
    sources: Iterable[str | Path | None] = (),
    kind: Callable[[Path], bool] = is_export_folder,
) -> Path:
    """Refuse a bad OUT before any work starts, so a long export is never lost to it; returns OUT resolved."""
    out = Path(out)
    real = _resolve(out, "output")
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current folder was deleted: nothing to protect
        cwd = None
    if cwd is not None and (real == cwd or real in cwd.parents):
        raise OutputFolderError(
            f"The output folder {out} is the current folder or holds it; give a new folder name (e.g. {out}/model)."
        )
    check_sources(out, sources)
    if out.is_symlink():
        raise OutputFolderError(f"Output path {out} is a symbolic link; give the real folder path instead.")
    if out.exists():
        if not out.is_dir():
            raise OutputExistsError(f"Output path {out} exists and is not a folder; remove it or choose another path.")
        if not force:
            raise OutputExistsError(f"Output folder {out} already exists; pass --force to replace it.")
        if not _replaceable(out, kind):
            raise OutputExistsError(
                f"Output folder {out} is not empty and not a gpt2edge folder; --force replaces only those, so "
                "remove it yourself or choose another path."
            )
    _probe_parent(real, out)
    return real


def _probe_parent(real: Path, out: Path) -> None:
    """Create and remove a folder in the nearest existing ancestor: a read-only or full disk fails here, early."""
    anc = real.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise OutputFolderError(f"Cannot create {out}: {anc} is not a folder; choose another path.")
    try:
        _make_temp(anc, real.name, "tmp").rmdir()
    except OSError as e:
        raise _write_error(e, out) from e


def _write_error(e: BaseException, out: Path) -> OutputFolderError:
    """The one-line error of a failed write: disk full, read-only, no permission, or the OS's own words."""
    code = getattr(e, "errno", None)
    if code in _DISK_FULL:
        return OutputFolderError(f"Disk full while writing {out}; nothing was written. Free space or choose another.")
    reason = _NO_WRITE.get(code, getattr(e, "strerror", None) or str(e))
    return OutputFolderError(f"Cannot write {out} ({reason}); nothing was written. Choose another output path.")


def _disk_full(parent: Path) -> bool:
    """Writers in C++ (protobuf, onnx) turn ENOSPC into their own exceptions: ask the file system instead."""
    try:
        return shutil.disk_usage(parent).free < (1 << 20)
    except OSError:
        return False


# --- temporary folders and their owners -----------------------------------------------------------------


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _start_token(pid: int) -> str:
    """The process start time (clock ticks since boot) from /proc, or "0" where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def _make_temp(parent: Path, name: str, kind: str) -> Path:
    """A new folder .NAME.KIND-HOST-PID-START-RANDOM in `parent` (mkdir: never an existing one)."""
    pid = os.getpid()
    path = parent / f".{name[:100]}.{kind}-{_host_tag()}-{pid}-{_start_token(pid)}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


def _owner_alive(host: str, pid: int, token: str) -> bool:
    """Whether the process that made a temp folder may still run; unknown (another host) counts as alive."""
    if host != _host_tag():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: it exists, under another user
    now = _start_token(pid)
    return token == "0" or now == "0" or now == token  # a different start time: the pid was reused


def clean_stale(parent: Path) -> list[Path]:
    """Remove the temp folders in `parent` whose process is gone (killed mid-write); returns what was removed."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            m = _TEMP_RE.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not _owner_alive(m[1], int(m[2]), m[3]):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    return removed


# --- the final rename -------------------------------------------------------------------------------------


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


def _restore(old: Path, out: Path) -> Path:
    """Put a folder moved aside back at `out`, or beside it when something took its place; returns where."""
    for dest in (out, out.with_name(f"{out.name}.replaced-{os.getpid()}")):
        try:
            rename_noreplace(old / "x", dest)
        except OSError:
            continue
        old.rmdir()
        return dest
    return old / "x"


def _install(tmp: Path, out: Path, shown: Path, force: bool, kind: Callable[[Path], bool]) -> None:
    """Move the finished folder to `out`, replacing only what --force authorises now."""
    appeared = (
        f"Output folder {shown} appeared while gpt2edge was writing; it was left untouched and nothing was written"
    )
    old = None
    if force and (out.exists() or out.is_symlink()):
        if not _replaceable(out, kind):
            raise OutputExistsError(appeared + " (it is not a gpt2edge folder, which --force may replace).")
        old = _make_temp(out.parent, out.name, "old")
        try:
            os.rename(out, old / "x")  # moved aside into a marked folder: a crash from here on leaves it cleanable
        except FileNotFoundError:  # removed meanwhile: nothing to replace
            old.rmdir()
            old = None
        if old is not None and not _replaceable(old / "x", kind):  # changed since the check: put it back
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
        shutil.rmtree(old, ignore_errors=True)


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
        tmp = _make_temp(real.parent, real.name, "tmp")
        tmp.chmod(0o777 & ~current_umask())  # a private (0700) folder until now; the result gets the usual permissions
    except OSError as e:
        raise _write_error(e, shown) from e
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
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise _write_error(e, shown) from e
        if isinstance(e, Exception) and not isinstance(e, Gpt2EdgeError) and _disk_full(real.parent):
            raise _write_error(OSError(errno.ENOSPC, "disk full"), shown) from e
        raise
