"""ASGI middleware around every request: its id, the API key check, one structured access-log line, and the
request metrics. Pure ASGI (not BaseHTTPMiddleware), so streams and client disconnects pass through untouched.

Request id: the client's X-Request-Id when it is a short token ([A-Za-z0-9._-], up to 64), else a new one;
returned in the response's X-Request-Id and written in the access log (logger "gpt2edge.access", one JSON
object per line). The API key is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpt2edge.serve.api.http import error_response
from gpt2edge.serve.api.protocol import ApiError
from gpt2edge.serve.config import ServeConfig

access_log = logging.getLogger("gpt2edge.access")
_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
OPEN_PATHS = ("/health", "/metrics")  # an orchestrator's probes and scrapes need no key
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize",
          "/slots")


def request_id(headers: Headers) -> str:
    given = headers.get("x-request-id", "")
    return given if _ID.match(given) else uuid.uuid4().hex


def _route(path: str) -> str:
    """A bounded label set for metrics: known routes, else "other"."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/slots/"):
        return "/slots/{id_slot}"
    return path if path in ROUTES else "other"


def head_label(scope: Scope) -> str | None:
    """X-Gpt2edge-Head on /v1 responses of a server whose folder has an approximate LM head, e.g.
    "approximate; mode=cluster; clusters=1024; probe=16; rows_per_step=784" (None otherwise)."""
    app = scope.get("app")
    scheduler = getattr(getattr(app, "state", None), "scheduler", None)
    head = getattr(scheduler, "head", None)
    if head is None or not scope["path"].startswith("/v1/"):
        return None
    return "; ".join(["approximate", *(f"{k}={v}" for k, v in head.items() if k != "approximate")])


class AccessMiddleware:
    def __init__(self, app: ASGIApp, config: ServeConfig, metrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = request_id(headers)
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = time.perf_counter()
        sent = {"status": 0, "bytes": 0}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                MutableHeaders(scope=message).append("x-request-id", rid)
                label = head_label(scope)
                if label is not None:
                    MutableHeaders(scope=message).append("x-gpt2edge-head", label)
            elif message["type"] == "http.response.body":
                sent["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            if self._authorized(scope["path"], headers):
                await self.app(scope, receive, send_with_id)
            else:
                denied = ApiError(401, "A valid API key is required: send 'Authorization: Bearer <key>'.", None,
                                  "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                await error_response(denied)(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - t0
            self._record(scope, state, rid, sent, elapsed)

    def _authorized(self, path: str, headers: Headers) -> bool:
        key = self.config.api_key
        if key is None or path in OPEN_PATHS:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # the header's own bytes (starlette reads headers as latin-1) against the key's (ASCII, config.py)
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key.encode())

    def _record(self, scope: Scope, state: dict, rid: str, sent: dict, elapsed: float) -> None:
        status = sent["status"] or 499  # no response started: the client left first
        self.metrics.requests.labels(_route(scope["path"]), str(status)).inc()
        self.metrics.duration.observe(elapsed)
        line = {
            "event": "access", "request_id": rid, "method": scope["method"], "path": scope["path"],
            "status": status, "duration_ms": round(elapsed * 1e3, 1), "bytes": sent["bytes"],
            "client": (scope.get("client") or ("", 0))[0],
        }  # fmt: skip
        job = state.get("job")
        if job is not None:
            line.update(job=job.id, rows=len(job.rows), prompt_tokens=sum(job.prompt_lens),
                        completion_tokens=sum(r.n_tokens for r in job.rows),
                        dropped=any(r.dropped for r in job.rows))  # fmt: skip
            if job.first_token_at is not None:
                line["ttft_ms"] = round((job.first_token_at - job.created) * 1e3, 1)
        access_log.info(json.dumps(line))
