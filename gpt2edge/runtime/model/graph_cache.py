"""ONNX Runtime's optimized graph saved once per folder, CPU and ONNX Runtime version, and loaded without
re-optimizing on later starts.

A CPU session of an export spends most of its start in ONNX Runtime: parsing a one-file graph's protobuf (every
weight copied out of it) and running the graph optimizers (fusions, constant folding). The first session saves
what it optimized (SessionOptions.optimized_model_filepath, its weights as external data that later sessions
memory-map: session.optimized_model_external_initializers_file_name) under the user's cache directory
(gpt2edge.manifest.verified.cache_root()/graphs/), never in the model folder: the folder may be on read-only
media and stays exactly what `export` wrote. Later sessions load that graph at ORT_DISABLE_ALL: the same nodes and
kernels as the session that optimized it, so the same values (tests/runtime/test_graph_cache.py).

An entry is used only when its record matches this start: the source graph files' sha256, size and mtime (a
changed folder), the ONNX Runtime version, this CPU (model name and feature flags, /proc/cpuinfo) and the session
options that change optimization. Its own files must have the size, mtime, ctime and inode recorded when they
were written (truncated or rewritten in place), or, with verify="full" (the CLI's --verify), the sha256 recorded
then. Anything else is said in one line (a RuntimeWarning) and the entry is rebuilt. GPT2EDGE_GRAPH_CACHE=0 turns
the cache off.

The cache is bounded: each entry written prunes the others (prune()): entries whose source graph is gone (and
that went unused a day), the leftovers of saves that were interrupted, then the least recently used until the
rest fit in GPT2EDGE_GRAPH_CACHE_BYTES (default 16G; the entry just written stays even when it alone is larger).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt2edge import __version__, cpu_facts
from gpt2edge.manifest import file_digest, resolve_inside, verified, write_text_atomic

GRAPH_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
RECORD_NAME = "record.json"
# ONNX Runtime maps external initializers from the file; a small one (a bias, a shape) stays inside the graph
EXTERNAL_MIN_BYTES = 1024
# the saved weights are a second copy of the folder's graph: leave this much disk free besides
DISK_MARGIN = 1 << 30
# the cache's size once an entry is written (GPT2EDGE_GRAPH_CACHE_BYTES): one xl fp32 entry and a dozen small ones
DEFAULT_LIMIT = 16 << 30
# a save's temporary folder older than this belongs to a start that was interrupted (a save takes seconds); an
# entry whose source graph is missing goes once unused this long (media unplugged for a while keep theirs)
STALE_BUILD_S = 24 * 3600
_ENTRY_NAME = re.compile(r"[0-9a-f]{40}")  # GraphCache.dir's names: prune() touches no other folder


def enabled(env: dict | None = None) -> bool:
    return (os.environ if env is None else env).get("GPT2EDGE_GRAPH_CACHE", "1") != "0"


def limit_bytes(env: dict | None = None) -> int:
    """GPT2EDGE_GRAPH_CACHE_BYTES (bytes, or with a unit: 8G, 512M), else DEFAULT_LIMIT; a value that is not a
    size is said in one line and the default used (a cache setting must not stop a model from loading)."""
    text = (os.environ if env is None else env).get("GPT2EDGE_GRAPH_CACHE_BYTES")
    if not text:
        return DEFAULT_LIMIT
    from gpt2edge.budget.memory import parse_size

    try:
        return parse_size(text)
    except (ValueError, OverflowError):
        warnings.warn(
            f"GPT2EDGE_GRAPH_CACHE_BYTES={text!r} is not a size (e.g. 8G); using {DEFAULT_LIMIT >> 30}G",
            RuntimeWarning,
            stacklevel=2,
        )
        return DEFAULT_LIMIT


def cpu_key() -> dict[str, str]:
    """This CPU as ONNX Runtime's kernels and optimizers see it: machine, model name and feature flags."""
    blocks = cpu_facts.cpuinfo_blocks(cpu_facts.read_text(cpu_facts.CPUINFO))
    first = blocks[0] if blocks else {}
    flags = first.get("flags") or first.get("Features") or ""
    return {"machine": cpu_facts.this_cpu().machine, "name": cpu_facts.this_cpu().name, "flags": flags}


def _stat(path: Path) -> dict[str, int]:
    return _stat_of(os.stat(path))


def _stat_of(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


@dataclass(frozen=True)
class GraphCache:
    """The cache entry of one source graph under one set of session options."""

    folder: Path  # the model folder
    graph: Path  # its graph as loaded (resolved)
    sources: dict[str, str]  # every source graph file (the .onnx and its external data) -> its manifest sha256
    full: bool = False  # verify="full": hash the cached files against their record instead of trusting stat
    options: tuple[tuple[str, str], ...] = ()  # the session options that change what the optimizers write

    @property
    def dir(self) -> Path:
        # one entry per graph path and options: a changed folder replaces its entry instead of adding one
        name = json.dumps({"graph": os.path.realpath(self.graph), "options": list(self.options)})
        return verified.cache_root() / "graphs" / hashlib.sha256(name.encode()).hexdigest()[:40]

    def source_paths(self) -> list[Path]:
        return [resolve_inside(self.folder, rel) for rel in sorted(self.sources)]

    def key(self) -> dict[str, Any]:
        """What the entry was made from; OSError when a source file cannot be stat'ed."""
        files = {}
        for rel, sha in sorted(self.sources.items()):
            st = os.stat(resolve_inside(self.folder, rel))
            # ctime and inode too: a graph rewritten in place with its mtime kept (cp -p, rsync -a) is a change
            files[rel] = {"sha256": sha, **_stat_of(st)}
        import onnxruntime as ort

        return {"gpt2edge": __version__, "onnxruntime": ort.__version__, "cpu": cpu_key(), "sources": files}

    def usable(self) -> Path | None:
        """The cached graph's path when its record matches this start and its files are intact; None when there is
        none yet (silently) or it cannot be used (saying why, in one line)."""
        record = verified.read_record(self.dir / RECORD_NAME, bad={})  # {}: present but unreadable, said and rebuilt
        if record is None:
            return None
        try:
            why = self._mismatch(record)
        except OSError as e:
            why = f"its files cannot be read ({e.strerror or e})"
        except (AttributeError, TypeError, KeyError, ValueError):  # valid JSON of another shape: not our record
            why = "its record is not one of gpt2edge's"
        if why is None:
            with contextlib.suppress(OSError):  # its last use, for prune(): the record's mtime (nothing checks it)
                os.utime(self.dir / RECORD_NAME)
            return self.dir / GRAPH_NAME
        warnings.warn(
            f"the optimized graph cached in {self.dir} is not used: {why}; rebuilding it", RuntimeWarning, stacklevel=2
        )
        return None

    def _mismatch(self, record: dict) -> str | None:
        key = self.key()
        files = record.get("files") if isinstance(record, dict) else None
        if not isinstance(record.get("key") if files is not None else None, dict) or not isinstance(files, dict):
            return "its record is not one of gpt2edge's"
        if not all(isinstance(want, dict) for want in files.values()):
            return "its record is not one of gpt2edge's"
        if record.get("key", {}).get("sources") != key["sources"]:
            return f"{self.folder} changed since it was made"
        for part, what in (("onnxruntime", "ONNX Runtime version"), ("cpu", "CPU"), ("gpt2edge", "gpt2edge version")):
            if record["key"].get(part) != key[part]:
                return f"it was made for another {what}"
        if sorted(record["files"]) != sorted((GRAPH_NAME, DATA_NAME)):
            return "its record lists other files"
        for name, want in record["files"].items():
            path = self.dir / name
            if self.full:
                if file_digest(path) != {"sha256": want.get("sha256"), "size": want.get("size")}:
                    return f"{name} does not match the sha256 recorded when it was written (changed)"
            elif {k: v for k, v in want.items() if k != "sha256"} != _stat(path):
                return f"{name} changed since it was written (size, mtime, ctime or inode differ: truncated or edited)"
        return None

    def writer(self, graph_bytes: int) -> Path | None:
        """A fresh temporary folder to save the optimized graph into (SessionOptions.optimized_model_filepath is
        its GRAPH_NAME), or None where the cache directory is not writable or lacks the disk space."""
        root = self.dir.parent
        try:
            root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(root).free
            if free < graph_bytes + DISK_MARGIN:
                warnings.warn(
                    f"the optimized graph is not cached: {free / 1e9:.1f} GB free in {root}, it needs "
                    f"{graph_bytes / 1e9:.1f} GB and {DISK_MARGIN >> 30} GB to spare",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return None
            return Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        except OSError:  # read-only or missing cache directory: this start optimizes, the next one again
            return None

    def commit(self, tmp: Path, before: dict[str, Any]) -> bool:
        """Record what `tmp` holds and move it into place (one rename: a reader sees the old entry, none, or the
        new one); `before` is key() from before the session was made. False when it was not kept (files
        missing, a source changed while it was saved, another process's entry won the race, or the disk
        refused)."""
        try:
            if not (tmp / GRAPH_NAME).is_file():
                return False
            if not (tmp / DATA_NAME).exists():  # a graph without large weights: an empty data file keeps one layout
                (tmp / DATA_NAME).touch()
            key = self.key()
            if key != before:
                return False
            settled = time.time_ns() - verified.SETTLE_NS
            if any(f["mtime_ns"] > settled for f in key["sources"].values()):
                return False  # a source written this recently could change again within the same clock tick
            files = {n: {**_stat(tmp / n), "sha256": file_digest(tmp / n)["sha256"]} for n in (GRAPH_NAME, DATA_NAME)}
            record = {"key": key, "files": files, "graph": os.path.realpath(self.graph)}  # graph: for prune()
            write_text_atomic(tmp / RECORD_NAME, json.dumps(record, indent=1) + "\n")
            old = self.dir.with_name(f".old-{self.dir.name}-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.dir, old)  # a stale entry leaves first
            os.rename(tmp, self.dir)
            shutil.rmtree(old, ignore_errors=True)
            try:
                prune(self.dir.parent, self.dir, limit_bytes())
            except Exception as e:  # the entry is written: bounding the cache must not fail the load
                warnings.warn(f"the optimized-graph cache was not pruned ({e})", RuntimeWarning, stacklevel=2)
            return True
        except OSError:
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def prune(root: Path, keep: Path, limit: int, now: float | None = None) -> list[Path]:
    """Bound the cache at `root` (its graphs/ folder) once `keep` was written; returns what it removed: entries
    whose source graph no longer exists and that went unused for STALE_BUILD_S, temporary folders of saves older
    than that (interrupted), then the least recently used entries (the record's mtime: written, or touched by
    usable()) until the rest, keep included, fit in `limit` bytes. keep is never removed, nor anything whose
    name is not an entry's or a save's. An entry goes by one rename first, so a reader sees it whole or not at
    all (one that had just found it usable reloads and rebuilds, saying so in one line)."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    entries: list[tuple[float, int, Path]] = []  # (last use, bytes, entry) of the entries that stay for now
    for path in _listing(root):
        if path == keep:
            continue
        if path.name.startswith((".build-", ".old-")):  # another start's save, or one that was interrupted
            if now - _mtime(path) > STALE_BUILD_S and _remove(path):
                removed.append(path)
            continue
        if not _ENTRY_NAME.fullmatch(path.name):  # not one of ours (GraphCache.dir's names): left alone
            continue
        record = verified.read_record(path / RECORD_NAME, bad={})
        used = _mtime(path / RECORD_NAME) or _mtime(path)  # no record: the folder's own time
        graph = record.get("graph") if isinstance(record, dict) else None
        if isinstance(graph, str) and _missing(graph) and now - used > STALE_BUILD_S:  # its folder deleted, moved
            if _remove(path):
                removed.append(path)
            continue
        entries.append((used, _bytes(path), path))
    total = _bytes(keep) + sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):  # the least recently used first
        if total <= limit:
            break
        if _remove(path):
            removed.append(path)
            total -= size
    return removed



def _missing(path: str) -> bool:
    """Whether `path` is known to be gone (not merely unreadable now: a permission error keeps the entry)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def _listing(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # gone or unreadable: 0 (prune() then takes the entry folder's own time)
        return 0.0


def _bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for f in path.iterdir():
            with contextlib.suppress(OSError):
                total += f.lstat().st_size
    return total


def _remove(path: Path) -> bool:
    """Take an entry out of the cache by one rename, then delete it; False if another start moved it first."""
    gone = path.with_name(f".old-{path.name.lstrip('.')}-pruned-{os.getpid()}")
    try:
        os.rename(path, gone)
    except OSError:
        return False
    shutil.rmtree(gone, ignore_errors=True)
    return True
