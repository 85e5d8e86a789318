"""llama-server's slot save / restore / erase (POST /slots/{id}?action=..., --slot-save-path DIR) on the
continuous scheduler's prefix cache.

A slot's state is the tokens of the last row that ran in it (slot_records.py) and their keys and values, which
the prefix cache kept when the row left. Save writes those tokens and the cache's longest path for them (whole
blocks) in gpt2edge.runtime.session_file's format: checksummed, tied to the folder's manifest, atomic. Restore
checks the file (same manifest and cache shape, size, sha256, no more cached positions than the cache can hold)
before anything changes, then puts its keys and values into the prefix cache and its tokens in the slot: the
next request that resends them reuses them (usage's cached_tokens) and gets the tokens it gets from the server
that saved it. Erase forgets the slot's tokens (their blocks stay in the shared cache until evicted).

Filenames come from clients: a bare name (NAME: letters, digits, `._+-`, not starting with a dot, at most 128
characters) inside DIR, never a path; a link or anything but a plain file is refused; messages name the file,
never DIR. Every refusal is a SlotRefusal (the api's 4xx, one line) and leaves the slot and the cache as they were.
"""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.errors import ServeError, SessionFileError
from gpt2edge.runtime.model.prefix_cache import BLOCK, PrefixCache
from gpt2edge.runtime.session_file import model_facts, read_session, save_session
from gpt2edge.serve.scheduling.slot_records import SlotBusy, SlotRecords

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
ACTIONS = ("save", "restore", "erase")


def slot_directory(path: str) -> Path:
    """--slot-save-path, made if missing; refused (ServeError) when it cannot be a writable folder."""
    where = Path(path).expanduser()
    try:
        where.mkdir(parents=True, exist_ok=True)
        where = where.resolve(strict=True)
    except (OSError, ValueError) as e:
        raise ServeError(f"--slot-save-path {path}: cannot make or open the folder: {e}.") from None
    if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
        raise ServeError(f"--slot-save-path {path} is not a folder this server can write to.")
    return where


class SlotRefusal(Exception):
    """A slot action refused: the api answers it with this HTTP status and OpenAI error fields (scheduling
    imports nothing of the api)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


class SlotFiles:
    """The slots of one ContinuousScheduler: its prefix cache's slot records and blocks, and the folder's LM
    (which ties a file to the folder); save_path None: no --slot-save-path (save and restore refused, 501)."""

    def __init__(self, records: SlotRecords, cache: PrefixCache, lm: Any, save_path: str | None) -> None:
        self.directory = None
        if save_path is not None:
            try:
                model_facts(lm)  # a folder whose cache cannot be saved is refused at start, not per request
            except SessionFileError as e:
                raise ServeError(f"--slot-save-path: {e}") from None
            self.directory = slot_directory(save_path)
        self.records, self.cache, self.lm = records, cache, lm
        self.n_ctx = int(lm.n_positions)

    def describe(self) -> list[dict[str, Any]]:
        """GET /slots: per slot, whether a row runs in it, and how many of its tokens the cache holds now."""
        return [
            {"id": s, "n_ctx": self.n_ctx, "is_processing": busy, "n_tokens": len(ids),
             "n_cached": len(self.cache.held(ids)) * BLOCK}
            for s, (busy, ids) in enumerate(self.records.snapshot())
        ]  # fmt: skip

    def action(self, slot: int, action: str, filename: Any) -> dict[str, Any]:
        """Run one POST /slots/{slot}?action=... (blocking: call it off the event loop)."""
        if action not in ACTIONS:
            raise SlotRefusal(400, f"Unknown slot action {action!r}; use one of {', '.join(ACTIONS)}.", "action",
                           "invalid_value")  # fmt: skip
        if not 0 <= slot < self.records.n:
            raise SlotRefusal(400, f"Slot {slot} does not exist; this server has slots 0..{self.records.n - 1}.",
                           "id_slot", "invalid_value")  # fmt: skip
        if action == "erase":
            return {"id_slot": slot, "n_erased": self._busy(slot, lambda: self.records.replace(slot, []))}
        if self.directory is None:
            raise SlotRefusal(501, "This server does not save or restore slots; start it with --slot-save-path DIR.",
                           None, "not_supported", "not_supported_error")  # fmt: skip
        path = self._path(filename)
        t0 = time.perf_counter()
        out = self._save(slot, path) if action == "save" else self._restore(slot, path)
        ms = round((time.perf_counter() - t0) * 1e3, 3)
        return {"id_slot": slot, "filename": filename, **out, "timings": {f"{action}_ms": ms}}

    def _save(self, slot: int, path: Path) -> dict[str, Any]:
        ids = self._busy(slot, lambda: self.records.tokens(slot))
        blocks = self.cache.held(ids)  # immutable arrays: safe to read while the scheduler adds and evicts
        cached = len(blocks) * BLOCK
        tensors = None  # none cached: the file holds the tokens only
        if blocks:
            tensors = [np.concatenate([b[t] for b in blocks], axis=1) for t in range(self.cache.shape[0])]
        self._plain(path, missing_ok=True)
        try:
            save_session(path, self.lm, ids, cached, tensors)
        except SessionFileError as e:
            raise self._refused(e, path, 500 if isinstance(e.__cause__, OSError) else 400) from None
        return {"n_saved": len(ids), "n_cached": cached, "n_written": path.stat().st_size}

    def _restore(self, slot: int, path: Path) -> dict[str, Any]:
        self._busy(slot, lambda: self.records.tokens(slot))  # refused before reading a file it could not take
        self._plain(path, missing_ok=False)
        room = self.cache.max_bytes // self.cache.block_bytes * BLOCK  # positions the cache can hold at all
        try:
            saved = read_session(path, self.lm, max_cached=room)
        except SessionFileError as e:
            raise self._refused(e, path, 400) from None
        ids = saved.tokens[: saved.cached]
        self.cache.insert(ids, saved.tensors)  # evicts older blocks for these (LRU), as any request's would
        self._busy(slot, lambda: self.records.replace(slot, saved.tokens))
        held = len(self.cache.held(ids)) * BLOCK  # fewer than saved.cached under memory pressure
        return {"n_restored": len(saved.tokens), "n_cached": held, "n_read": path.stat().st_size}

    def _path(self, filename: Any) -> Path:
        """The file's path inside the slot folder: a bare NAME, never a path."""
        if not isinstance(filename, str) or not NAME.fullmatch(filename):
            raise SlotRefusal(400, "Invalid filename: give a bare name (letters, digits and ._+-, not starting with a "
                           "dot, at most 128 characters) in the body as {\"filename\": NAME}.", "filename",
                           "invalid_value")  # fmt: skip
        return self.directory / filename

    def _plain(self, path: Path, missing_ok: bool) -> None:
        """Refuse a link or anything but a plain file under that name (a restore also refuses none)."""
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            if missing_ok:
                return
            raise SlotRefusal(404, f"No slot file named {path.name!r} in the slot save path.", "filename",
                           "not_found") from None  # fmt: skip
        except OSError as e:
            raise SlotRefusal(400, f"Cannot read the slot file {path.name!r}: {e.strerror}.", "filename") from None
        if not stat.S_ISREG(mode):
            raise SlotRefusal(400, f"{path.name!r} in the slot save path is not a plain file (a link or a folder); "
                           "choose another name.", "filename", "invalid_value")  # fmt: skip

    def _busy(self, slot: int, read):
        try:
            return read()
        except SlotBusy:
            raise SlotRefusal(409, f"Slot {slot} is processing a request; retry when it has finished (GET /slots).",
                           "id_slot", "slot_busy") from None  # fmt: skip

    def _refused(self, e: SessionFileError, path: Path, status: int) -> SlotRefusal:
        """The session file's one line, naming the file as the client did, not where the server keeps it."""
        message = str(e).replace(str(path), repr(path.name)).replace(str(self.directory), "the slot save path")
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return SlotRefusal(status, message, "filename", "invalid_slot_file", kind)
