"""llama-server's slot endpoints: GET /slots, and POST /slots/{id_slot}?action=save|restore|erase with
{"filename": NAME} (save and restore need --slot-save-path; the work: serve/scheduling/slot_files.py).

Both need the continuous scheduler's prefix cache (--prefix-cache-bytes > 0): without it there are no slots
(501, naming the flag). They take the API key like /v1 (the slots' token counts are the clients' business).
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from fastapi import APIRouter, Request

from gpt2edge.serve.api.completions import ready_scheduler
from gpt2edge.serve.api.http import read_body
from gpt2edge.serve.api.protocol import ApiError
from gpt2edge.serve.scheduling.slot_files import SlotFiles, SlotRefusal

router = APIRouter()
MAX_SLOT_BODY = 4096  # {"filename": NAME}: a name is at most 128 characters


def _slot_files(request: Request) -> SlotFiles:
    files = ready_scheduler(request).slot_files
    if files is None:
        raise ApiError(501, "This server has no slots: start it with --prefix-cache-bytes > 0 (the continuous "
                       "scheduler's prefix cache holds their keys and values).", None, "not_supported",
                       "not_supported_error")  # fmt: skip
    return files


@router.get("/slots")
async def slots(request: Request) -> list[dict[str, Any]]:
    return _slot_files(request).describe()


@router.post("/slots/{id_slot}")
async def slot_action(request: Request, id_slot: str, action: str = "") -> dict[str, Any]:
    files = _slot_files(request)
    if not id_slot.isascii() or not id_slot.isdigit() or len(id_slot) > 9:
        raise ApiError(400, f"The slot id must be a whole number, got {id_slot[:40]!r}.", "id_slot", "invalid_value")
    body = await read_body(request, MAX_SLOT_BODY, request.app.state.config.body_timeout_s)
    filename = None
    if action in ("save", "restore"):  # erase takes no body; an unknown action is refused by name
        try:
            obj = json.loads(body.decode("utf-8")) if body.strip() else {}
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise ApiError(400, "The body must be a JSON object such as {\"filename\": \"chat.bin\"}.", None,
                           "invalid_json") from None  # fmt: skip
        if not isinstance(obj, dict):
            raise ApiError(400, "The body must be a JSON object such as {\"filename\": \"chat.bin\"}.", None,
                           "invalid_json")  # fmt: skip
        filename = obj.get("filename")
    try:  # file I/O and a sha256 over up to one row's cache: off the event loop
        return await anyio.to_thread.run_sync(files.action, int(id_slot), action, filename)
    except SlotRefusal as e:
        raise ApiError(e.status, e.message, e.param, e.code, e.type) from None
