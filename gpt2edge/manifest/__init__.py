"""The manifest of an export folder on disk: read and validated, written atomically with a checksum of every
file, and every listed file verified against it.

Everything that runs a folder (runtime, quantize, parity, bench) reads it from here; nothing infers a recipe
from file names. The typed records live in gpt2edge.manifest.records. No torch or onnx import: the runtime uses
this on the device.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpt2edge.errors import ChecksumError, ModelFolderError
from gpt2edge.manifest.external_data import check_external_data
from gpt2edge.manifest.fields import shown_path
from gpt2edge.manifest.records import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    GraphInfo,
    Manifest,
    check_relpath,
)

# names whose home is now gpt2edge.manifest.records, still imported from here by the tests and gpt2edge.runtime.model.lm
from gpt2edge.manifest.records import HEAD_MODES as HEAD_MODES
from gpt2edge.manifest.records import KEEP_INPUT as KEEP_INPUT
from gpt2edge.manifest.records import KV_CACHE_MODES as KV_CACHE_MODES
from gpt2edge.manifest.records import PRECISIONS as PRECISIONS


def resolve_inside(folder: Path, rel: str) -> Path:
    """folder/rel with symlinks resolved, refused when it lands outside the folder."""
    root = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(root / check_relpath(rel, str(folder))))
    if target == root or not target.is_relative_to(root):
        raise ModelFolderError(
            f"{folder}: {shown_path(rel)} points outside the folder (a symlink?); re-export the model."
        )
    return target


def file_digest(path: Path) -> dict[str, Any]:
    """sha256 and size of one file, read in 1 MiB chunks so multi-GB data files never sit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"sha256": h.hexdigest(), "size": path.stat().st_size}


def digest_folder(folder: Path) -> dict[str, dict[str, Any]]:
    """Digests of every file in the folder except the manifest itself, keyed by relative path."""
    folder = Path(folder)
    return {
        p.relative_to(folder).as_posix(): file_digest(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != MANIFEST_NAME
    }


def write_text_atomic(path: Path, text: str) -> None:
    """Write a temp file beside `path`, flush it to disk, then rename it over: readers see old or new, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Fill in the file digests and write manifest.json (atomically); returns the manifest as written."""
    manifest = dict(manifest)
    manifest["format"] = FORMAT
    manifest["format_version"] = FORMAT_VERSION
    manifest["files"] = digest_folder(folder)
    Manifest.from_json(manifest, str(Path(folder) / MANIFEST_NAME))  # never write one the reader refuses
    write_text_atomic(Path(folder) / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def load_manifest(folder: Path) -> Manifest:
    """Load and validate manifest.json, raising a ModelFolderError that says what is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"Model folder {folder} does not exist (make one with `gpt2edge export`).")
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ModelFolderError(
            f"{folder} is not a gpt2edge export: it has no {MANIFEST_NAME} (make one with `gpt2edge export`)."
        )
    resolve_inside(folder, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(MAX_MANIFEST_BYTES + 1) if size <= MAX_MANIFEST_BYTES else b""
    except OSError as e:
        raise ModelFolderError(f"{path} cannot be read ({_reason(e)}); re-export the model.") from e
    if max(size, len(raw)) > MAX_MANIFEST_BYTES:
        raise ModelFolderError(
            f"{path} is {size / 2**20:.1f} MB; a gpt2edge manifest is a few kB (at most "
            f"{MAX_MANIFEST_BYTES >> 20} MB read): re-export the model."
        )
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys(path))
    except (ValueError, RecursionError) as e:  # not UTF-8, bad JSON, an int of > 4300 digits; nested too deep
        raise ModelFolderError(f"{path} is not valid JSON ({e}); re-export the model.") from e
    return Manifest.from_json(data, str(path))


def _unique_keys(path: Path):
    """json.loads' object_pairs_hook: a key given twice in one object is refused (json would keep the last one
    silently, another reader the first: the manifest would mean two things)."""

    def pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ModelFolderError(
                    f"{path}: the key {shown_path(key, quoted=True)} is given twice in one object; re-export the model."
                )
            out[key] = value
        return out

    return pairs_to_dict


def _reason(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _unreadable(folder: Path, rel: str, e: OSError) -> ModelFolderError:
    return ModelFolderError(f"{folder}: {shown_path(rel)} cannot be read ({_reason(e)}); re-export the model.")


def graph_files(manifest: dict[str, Any] | Manifest) -> list[str]:
    """The files of the graph: the .onnx and, for graphs over 2 GB, its external data."""
    if isinstance(manifest, Manifest):
        return list(manifest.graph.files)
    return list(GraphInfo.from_json(manifest.get("graph"), MANIFEST_NAME).files)


def check_present(folder: Path, names: tuple[str, ...] | list[str]) -> None:
    """Each named file is a regular file inside the folder (what --no-verify still checks)."""
    for rel in names:
        try:
            present = resolve_inside(folder, rel).is_file()
        except OSError as e:  # e.g. a name longer than the OS allows
            raise _unreadable(folder, rel, e) from e
        if not present:
            raise ModelFolderError(f"{folder} is incomplete: {shown_path(rel)} is listed in the manifest but missing.")


def verify_files(folder: Path, manifest: dict[str, Any] | Manifest) -> None:
    """Check every file listed in the manifest is inside the folder with the recorded size and sha256."""
    folder = Path(folder)
    if not isinstance(manifest, Manifest):
        manifest = Manifest.from_json(manifest, str(folder / MANIFEST_NAME))
    for rel, expected in manifest.files.items():
        check_present(folder, [rel])
        p = resolve_inside(folder, rel)
        try:
            digest = file_digest(p)
        except OSError as e:  # unreadable (permissions, I/O error)
            raise _unreadable(folder, rel, e) from e
        if digest != asdict(expected):
            # no flag named here: only some commands can skip the check (the CLI adds --no-verify where it can)
            raise ChecksumError(
                f"{folder / rel} does not match its manifest checksum (modified or corrupted); re-export the model."
            )
    check_external_data(folder, manifest)  # and the graph loads no file but those
