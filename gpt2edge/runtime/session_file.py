"""A session's state in one file (`Conversation.save` / `load`, `-i`'s /save and /load; llama-server's slot
save/restore): its token history and its one row's KV cache, checksummed and tied to the export folder.

Layout: MAGIC, the header's length (uint64 little-endian), the header (UTF-8 JSON), then the payload: the history
as int64, then the cache's 2 x n_layer (n_head, cached, head_dim) key/value tensors in the folder's kv_dtype, all
little-endian. The header holds the format version, the gpt2edge version, the sha256 of the folder's manifest.json
and of its graph file, the model's cache shape, the counts, and the payload's size and sha256.

A restore checks, before anything in the session changes: the magic and format version, the manifest's sha256
(the same folder, not a re-export or another model), the cache shape and counts against this model (so a header
cannot make it read more than one row of the model's cache), the file's size (truncation), then the payload's
sha256 (damage: a flipped byte; being unkeyed, it is no proof against deliberate edits). Every refusal is one
SessionFileError line. A save writes a temp file beside the named one,
fsyncs it and renames it over: the named file is old or new, never half, and no other file is touched.

The sampler keeps no RNG between turns (each turn seeds its own from its `seed`), so there is none to save.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge import __version__
from gpt2edge.api_args import path_arg
from gpt2edge.errors import SessionFileError
from gpt2edge.manifest.records import MANIFEST_NAME
from gpt2edge.runtime.model.contract import LM

MAGIC = b"gpt2edge-session\n"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 1 << 16  # a header is a few hundred bytes; a larger length field is garbage, not read
_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class SavedSession:
    """A checked file's content: the history and the cache tensors for its first `cached` positions."""

    tokens: list[int]
    cached: int
    tensors: list[np.ndarray]


def model_facts(lm: LM) -> dict[str, Any]:
    """What ties a file to this folder and sizes its arrays; refuses an LM whose cache cannot be saved."""
    if not lm.supports_row_state:
        raise SessionFileError(
            "saving and restoring a session needs a concat or shared KV-cache folder on CPU (not a static-shape, "
            "sparse-head or CUDA one)."
        )
    folder = lm.folder
    try:
        manifest = (Path(folder.path) / MANIFEST_NAME).read_bytes()
    except OSError as e:  # the folder moved or was deleted since the Generator loaded it
        raise SessionFileError(f"cannot read {folder.path}/{MANIFEST_NAME}: {e.strerror or e}.") from e
    graph = folder.info.files.get(folder.graph.file)
    return {
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "graph_sha256": graph.sha256 if graph is not None else None,
        "kv_cache": folder.kv_cache,
        "kv_dtype": np.dtype(lm.kv_dtype).name,
        "n_layer": lm.n_layer,
        "n_head": lm.n_head,
        "head_dim": lm.head_dim,
        "n_positions": lm.n_positions,
    }


def save_session(
    path: str | os.PathLike, lm: LM, tokens: list[int], cached: int, tensors: list[np.ndarray] | None = None
) -> Path:
    """Write `tokens` and the first `cached` positions of `lm`'s one-row cache to `path`, atomically; or, given
    `tensors` (2 x n_layer of (n_head, cached, head_dim): a server slot's prefix-cache blocks), those."""
    path = path_arg(path, "path")
    facts = model_facts(lm)
    try:  # a name too long for the file system, or with a NUL, raises from the checks themselves
        if path.is_dir():
            raise SessionFileError(f"{path} is a directory; name the file to save the session to.")
        if not path.parent.is_dir():
            raise SessionFileError(f"cannot save the session to {path}: its folder {path.parent} does not exist.")
    except (OSError, ValueError) as e:
        raise SessionFileError(f"cannot save the session to {str(path)[:200]}: {e}.") from None
    dtype = np.dtype(lm.kv_dtype).newbyteorder("<")
    arrays = [np.asarray(tokens, dtype="<i8")]
    if cached:
        arrays += [np.ascontiguousarray(t, dtype=dtype) for t in (lm.row_tensors() if tensors is None else tensors)]
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(memoryview(a).cast("B"))
    header = {
        "format": "gpt2edge-session", "format_version": FORMAT_VERSION, "gpt2edge_version": __version__, **facts,
        "tokens": len(tokens), "cached": cached, "payload_bytes": sum(a.nbytes for a in arrays),
        "payload_sha256": digest.hexdigest(),
    }  # fmt: skip
    head = json.dumps(header).encode()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    except (OSError, ValueError) as e:
        raise SessionFileError(f"cannot save the session to {path}: {e.strerror or e}.") from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LENGTH.pack(len(head)) + head)
            for a in arrays:
                f.write(memoryview(a).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise SessionFileError(f"cannot save the session to {path}: {e.strerror or e}.") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_session(path: str | os.PathLike, lm: LM, max_cached: int | None = None) -> SavedSession:
    """Read and check a saved session for `lm`'s folder; raises SessionFileError, reading no array larger than
    the model's cache (nor, given max_cached, a file holding more cached positions: refused before its payload
    is read, e.g. one that a server's prefix cache could not hold)."""
    path = path_arg(path, "path")
    facts = model_facts(lm)
    try:
        is_file = path.is_file()
    except (OSError, ValueError) as e:  # a name too long, or with a NUL
        raise SessionFileError(f"cannot read a session from {str(path)[:200]}: {e}.") from None
    if not is_file:
        raise SessionFileError(f"{path} is not a file; name a session file written by /save or Session.save.")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header, start = _header(f, path)
            expected = _check_header(header, facts, path)
            if max_cached is not None and header["cached"] > max_cached:
                raise SessionFileError(
                    f"{path} holds {header['cached']} cached positions, more than the {max_cached} that fit here."
                )
            if size != start + expected:
                raise SessionFileError(
                    f"{path} is truncated or has extra bytes: {size} bytes, its header says {start + expected}."
                )
            payload = f.read(expected)
    except OSError as e:
        raise SessionFileError(f"cannot read the session file {path}: {e.strerror or e}.") from e
    if len(payload) != expected:
        raise SessionFileError(
            f"{path} is truncated: {start + len(payload)} bytes, its header says {start + expected}."
        )
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise SessionFileError(f"{path} is damaged: its payload does not match its sha256; save the session again.")
    n, cached = header["tokens"], header["cached"]
    tokens = np.frombuffer(payload, dtype="<i8", count=n)
    if n and (tokens.min() < 0 or tokens.max() >= lm.vocab_size):
        raise SessionFileError(f"{path} holds token ids outside this model's vocabulary.")
    shape = (lm.n_head, cached, lm.head_dim)
    dtype = np.dtype(lm.kv_dtype).newbyteorder("<")
    step = int(np.prod(shape)) * dtype.itemsize
    tensors = [
        np.frombuffer(payload, dtype=dtype, count=int(np.prod(shape)), offset=8 * n + i * step).reshape(shape)
        for i in range(2 * lm.n_layer if cached else 0)
    ]
    return SavedSession(tokens=[int(t) for t in tokens], cached=cached, tensors=tensors)


def _header(f, path: Path) -> tuple[dict[str, Any], int]:
    """The header after the magic and its length; (header, offset of the payload)."""
    lead = f.read(len(MAGIC) + _LENGTH.size)
    if len(lead) < len(MAGIC) or lead[: len(MAGIC)] != MAGIC:
        raise SessionFileError(f"{path} is not a gpt2edge session file (no session header).")
    if len(lead) < len(MAGIC) + _LENGTH.size:
        raise SessionFileError(f"{path} is truncated: it ends inside its header.")
    (length,) = _LENGTH.unpack(lead[len(MAGIC) :])
    if length > MAX_HEADER_BYTES:
        raise SessionFileError(f"{path} is damaged: its header claims {length} bytes.")
    raw = f.read(length)
    if len(raw) != length:
        raise SessionFileError(f"{path} is truncated: it ends inside its header.")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SessionFileError(f"{path} is damaged: its header is not JSON.") from e
    if not isinstance(header, dict):
        raise SessionFileError(f"{path} is damaged: its header is not a JSON object.")
    return header, len(lead) + length


def _check_header(header: dict[str, Any], facts: dict[str, Any], path: Path) -> int:
    """Refuse another format, another folder or a shape this model cannot hold; returns the payload's bytes."""
    if header.get("format") != "gpt2edge-session" or header.get("format_version") != FORMAT_VERSION:
        raise SessionFileError(
            f"{path} is session format {header.get('format_version')!r} (gpt2edge "
            f"{header.get('gpt2edge_version')}); this gpt2edge {__version__} reads format {FORMAT_VERSION} only."
        )
    if header.get("manifest_sha256") != facts["manifest_sha256"]:
        raise SessionFileError(
            f"{path} was saved from another export folder (its manifest's sha256 differs); load it with the "
            "folder it was saved from."
        )
    if any(header.get(k) != v for k, v in facts.items()):
        raise SessionFileError(f"{path} does not match this model's KV cache shape; save the session again.")
    n, cached, n_pos = header.get("tokens"), header.get("cached"), facts["n_positions"]
    ints = all(type(v) is int for v in (n, cached))
    if not ints or not 0 <= cached <= n <= n_pos or not isinstance(header.get("payload_sha256"), str):
        raise SessionFileError(
            f"{path} is damaged: it claims {n!r} tokens and {cached!r} cached positions for a model of {n_pos}."
        )
    per_position = 2 * facts["n_layer"] * facts["n_head"] * facts["head_dim"] * np.dtype(facts["kv_dtype"]).itemsize
    expected = 8 * n + cached * per_position
    if header.get("payload_bytes") != expected:
        raise SessionFileError(f"{path} is damaged: its payload size does not match its counts.")
    return expected
