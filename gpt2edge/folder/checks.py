"""The checks on an output folder OUT before any work starts, so a long export is never lost to a bad OUT.

OUT is not the input, not inside it, not holding it; not the current folder or one of its parents; an existing
OUT needs --force, and --force replaces only a folder of the expected kind (`is_export_folder`,
`is_checkpoint_folder`). A read-only or full disk is found here too, by creating and removing a temp folder.
The failed-write errors (`write_error`) are shared with gpt2edge.folder, which builds and installs OUT.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from gpt2edge.errors import OutputExistsError, OutputFolderError
from gpt2edge.folder.temp import make_temp, restore_stale
from gpt2edge.manifest.records import FORMAT, MANIFEST_NAME, MAX_MANIFEST_BYTES

DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NO_WRITE = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "not permitted"}


def is_export_folder(path: Path) -> bool:
    """True for a folder that holds a gpt2edge manifest: what `export/quantize --force` may replace."""
    manifest = Path(path) / MANIFEST_NAME
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:  # not one gpt2edge wrote; a huge file is not read
            return False
        data = json.loads(manifest.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def is_checkpoint_folder(path: Path) -> bool:
    """True for a Hugging Face checkpoint folder (config.json + weights): what `random-checkpoint --force` replaces."""
    p = Path(path)
    return (p / "config.json").is_file() and any((p / w).is_file() for w in ("model.safetensors", "pytorch_model.bin"))


def replaceable(path: Path, kind: Callable[[Path], bool]) -> bool:
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


def check_inputs(out: Path, inputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """Refuse an input file or folder (named `what` in the message) that is OUT or lies inside it: writing OUT
    (with --force: replacing it) would delete the input. Symlinks resolved; a path that does not exist yet is
    compared as written (it may be created before OUT is replaced)."""
    real = _resolve(out, "output")
    for what, src in inputs:
        if src is None:
            continue
        s = _resolve(Path(src), "input")
        if s == real:
            kind = "folder" if s.is_dir() else "file"
            raise OutputFolderError(
                f"The output {kind} is the input {kind} ({what}); writing the output would delete it, even with "
                "--force. Write the output elsewhere."
            )
        if real in s.parents:
            raise OutputFolderError(
                f"The input {what} lies inside the output folder {out}; replacing the folder would delete it, even "
                "with --force. Move it out of the folder or choose another output path."
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
    restore_stale(real.parent)  # an OUT a killed swap left aside is put back first, so the checks below see it
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
        if not replaceable(out, kind):
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
        make_temp(anc, real.name, "tmp").rmdir()
    except OSError as e:
        raise write_error(e, out) from e


def write_error(e: BaseException, out: Path) -> OutputFolderError:
    """The one-line error of a failed write: disk full, read-only, no permission, or the OS's own words."""
    code = getattr(e, "errno", None)
    if code in DISK_FULL:
        return OutputFolderError(f"Disk full while writing {out}; nothing was written. Free space or choose another.")
    reason = _NO_WRITE.get(code, getattr(e, "strerror", None) or str(e))
    return OutputFolderError(f"Cannot write {out} ({reason}); nothing was written. Choose another output path.")


def disk_full(parent: Path) -> bool:
    """Writers in C++ (protobuf, onnx) turn ENOSPC into their own exceptions: ask the file system instead."""
    try:
        return shutil.disk_usage(parent).free < (1 << 20)
    except OSError:
        return False
