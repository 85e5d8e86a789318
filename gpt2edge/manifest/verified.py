"""A record of a folder that passed its full sha256 check, so a later open of the unchanged files skips re-hashing.

The record lives under the user's cache directory ($GPT2EDGE_CACHE_DIR, else $XDG_CACHE_HOME/gpt2edge or
~/.cache/gpt2edge, then verified/), never
in the model folder: the folder may be on read-only media and stays exactly what `export` wrote. It is keyed by
the folder's real path and the manifest's sha256, and lists every file's size, mtime_ns, ctime_ns, inode and
device with the sha256 it matched. The fast check trusts that a file whose stat fields are all unchanged has
unchanged bytes: os.utime can restore mtime but not ctime, so rewriting a file in place is caught, but a
writer that also resets the clock (root), edits the block device, or forges the record is not: `verify="full"`
(the CLI's --verify) always hashes every byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from gpt2edge import __version__
from gpt2edge.errors import Gpt2EdgeError
from gpt2edge.manifest import resolve_inside, verify_files, write_text_atomic
from gpt2edge.manifest.records import MANIFEST_NAME, Manifest

VERIFY_MODES = ("fast", "full")  # plus False: presence only (ModelFolder.open)
MAX_RECORD_BYTES = 1 << 20  # a record is a few kB; a larger file there is not one of ours
# file times come from a coarse clock (a few ms a tick; FAT: 2 s): a file written this recently could be
# rewritten within the same tick with the same size and times, so it gets no record yet ("racy git")
SETTLE_NS = 2_000_000_000


def cache_root() -> Path:
    """$GPT2EDGE_CACHE_DIR, else $XDG_CACHE_HOME/gpt2edge, else ~/.cache/gpt2edge (the XDG default)."""
    if os.environ.get("GPT2EDGE_CACHE_DIR"):
        return Path(os.environ["GPT2EDGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpt2edge"


def verify_folder(folder: Path, manifest: Manifest, mode: str = "fast") -> str:
    """Check every listed file: "full" hashes all of them; "fast" skips hashing when a record of an earlier full
    check matches every file's stat and the manifest's bytes. Returns "record" or "hashed"; a wrong checksum
    raises ChecksumError exactly as verify_files does."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES} (or True/False), got {mode!r}")
    folder = Path(folder)
    try:  # the record's key and the files' stat now; a file that cannot be stat'ed: the full check names it
        manifest_sha = hashlib.sha256(resolve_inside(folder, MANIFEST_NAME).read_bytes()).hexdigest()
        before = _stats(folder, manifest)
    except (OSError, Gpt2EdgeError):
        verify_files(folder, manifest)
        return "hashed"
    path = _record_path(folder, manifest_sha)
    expected = {"version": __version__, "manifest_sha256": manifest_sha, "files": before}
    if mode == "fast" and read_record(path) == expected:
        # no check_external_data again (~10-20 ms of protobuf walking a start): the full check that wrote this
        # record ran it on these very bytes (same gpt2edge version, same manifest, same stat of every file), and
        # the record is trusted for exactly that: that unchanged stat fields mean unchanged bytes
        return "record"
    verify_files(folder, manifest)
    # record only what was hashed: a file changed while it was read (stat differs after) or that changed
    # too recently for its times to tell another change apart gets no record
    try:
        settled = time.time_ns() - SETTLE_NS
        recent = any(max(f["mtime_ns"], f["ctime_ns"]) > settled for f in before.values())
        if not recent and _stats(folder, manifest) == before:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(expected, indent=1, sort_keys=True) + "\n")
    except OSError:  # read-only or missing cache directory: no record, the next open hashes again
        pass
    return "hashed"


def _stats(folder: Path, manifest: Manifest) -> dict[str, dict[str, Any]]:
    """Per listed file: the stat fields that change when its bytes are rewritten, and the sha256 it must match
    (so a record made for another manifest's checksums never matches this one)."""
    out = {}
    for rel, expected in manifest.files.items():
        st = os.stat(resolve_inside(folder, rel))
        out[rel] = {
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino,
            "dev": st.st_dev,
            "sha256": expected.sha256,
        }
    return out


def _record_path(folder: Path, manifest_sha: str) -> Path:
    key = hashlib.sha256(f"{os.path.realpath(folder)}\0{manifest_sha}".encode()).hexdigest()[:40]
    return cache_root() / "verified" / f"{key}.json"


def read_record(path: Path, bad: Any = None) -> Any:
    """A cache record's JSON (this folder check's, the graph cache's), reading at most MAX_RECORD_BYTES: None when
    the file (or its directory) is absent, `bad` when it is present but unreadable, oversized or not JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
        return json.loads(raw) if len(raw) <= MAX_RECORD_BYTES else bad
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, RecursionError):
        return bad
