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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
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


def enabled(env: dict | None = None) -> bool:
    return (os.environ if env is None else env).get("GPT2EDGE_GRAPH_CACHE", "1") != "0"


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
            write_text_atomic(tmp / RECORD_NAME, json.dumps({"key": key, "files": files}, indent=1) + "\n")
            old = self.dir.with_name(f".old-{self.dir.name}-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.dir, old)  # a stale entry leaves first
            os.rename(tmp, self.dir)
            shutil.rmtree(old, ignore_errors=True)
            return True
        except OSError:
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
