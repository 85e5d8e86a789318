"""ASGI plumbing the routes share: a bounded body read, client-disconnect detection, an SSE response."""

from __future__ import annotations

from collections.abc import Callable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from gpt2edge.serve.api.protocol import ApiError


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed `limit` bytes (never buffered past it),
    and (408) when it has not all arrived within timeout_s seconds (a client trickling it ties up a socket)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        message = f"The request body did not arrive within {timeout_s:g} s (--body-timeout); send it at once."
        raise ApiError(408, message, None, "body_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; retry on another replica or later.", None, "shutting_down",
                    "server_error", {"Retry-After": "1"})  # fmt: skip


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body exceeds this server's {limit} bytes (--max-body-kb).", None, "too_large")


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone away (call only after the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """text/event-stream that always watches for the client leaving, whatever ASGI version the server speaks.

    On disconnect (or a failed write) the event generator is closed, so its `finally` frees the request's rows;
    on_close runs in every case.
    """

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket closed under a write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            self._on_close()
