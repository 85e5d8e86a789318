"""What uvicorn's h11 protocol lacks against idle, slow and malformed clients: a deadline for a request's headers,
a hard cap on open connections, a cap on the request head however it arrives (h11's max_incomplete_event_size
counts only a head still incomplete: one sent in a single piece passed whatever its size), and no request that
frames its body twice. (A body's deadline: http.read_body; idle keep-alive connections: uvicorn's
timeout_keep_alive. All set from ServeConfig in server.py.)

Without them, connections that send nothing or half their headers are never closed: a few hundred such sockets
exhaust the process's file descriptors and lock every other client out.
"""

from __future__ import annotations

import asyncio
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
BUSY_RESPONSE = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
LINGER_QUIET_S, LINGER_MAX_S = 0.5, 5.0  # after refusing a head: read and drop what follows, then close
_HEAD_END = re.compile(rb"\n\r?\n")  # h11's end of a request head


def _refusal(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}"
            "\r\nconnection: close\r\n\r\n").encode() + body  # fmt: skip


class CheckedConnection(h11.Connection):
    """h11's server side with the head capped however it arrives, and Content-Length with Transfer-Encoding
    refused (RFC 9112 6.3: the pair is how request smuggling starts; a server may reject it, and this one does)."""

    max_head_bytes = 16 * 1024
    refusal: bytes | None = None  # the response to a request refused here (uvicorn's handler sends it)

    def _refuse(self, status: int, reason: str, message: str):
        self.refusal = _refusal(status, reason, message)
        return h11.RemoteProtocolError(message, error_status_hint=status)

    def next_event(self):
        if self.their_state is h11.IDLE:
            data, _ = self.trailing_data
            end = _HEAD_END.search(data, 0, self.max_head_bytes + 4)
            if (end.end() if end else len(data)) > self.max_head_bytes:
                message = f"The request head exceeds this server's {self.max_head_bytes} bytes (--max-header-kb)."
                raise self._refuse(431, "Request Header Fields Too Large", message)
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                message = "A request must not send both Content-Length and Transfer-Encoding (RFC 9112); send one."
                raise self._refuse(400, "Bad Request", message)
        return event


def limited_protocol(header_timeout_s: float, max_connections: int, max_head_bytes: int = 16 * 1024) -> type:
    """An H11Protocol class with these limits (uvicorn.Config(http=...) takes the class)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "max_connections": max_connections, "max_head_bytes": max_head_bytes,
    })  # fmt: skip


class LimitedH11Protocol(H11Protocol):
    header_timeout_s = 10.0  # from connecting, or from a request's first byte, to its last header
    max_connections = 512  # open connections; one more is answered 503 and closed at once
    max_head_bytes = 16 * 1024  # a request line and headers, together

    _header_timer: asyncio.TimerHandle | None = None
    _linger: asyncio.TimerHandle | None = None
    _linger_until = 0.0
    _refused = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the same h11 connection uvicorn makes (its incomplete-event cap included), with the checks above
        checked = type("Checked", (CheckedConnection,), {"max_head_bytes": self.max_head_bytes})
        cap = self.config.h11_max_incomplete_event_size
        # no cap configured: h11's own default (its constructor's), not a private constant of h11 copied here
        self.conn = checked(h11.SERVER) if cap is None else checked(h11.SERVER, cap)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        if self._refused:  # the rest of a refused request: dropped unread, until the client goes quiet
            self._linger_on()
            return
        super().data_received(data)
        self._watch_headers()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse; ours to one CheckedConnection refused."""
        refusal = getattr(self.conn, "refusal", None)
        if refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(refusal)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def _refuse(self, response: bytes) -> None:
        """Answer, stop sending, and read what the client still sends for a moment before closing: closing with
        unread data would reset the connection and the client could lose the answer."""
        self._refused = True
        self._stop_header_timer()
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_until = self.loop.time() + LINGER_MAX_S
        self._linger_on()

    def _linger_on(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
        wait = min(LINGER_QUIET_S, max(0.0, self._linger_until - self.loop.time()))
        self._linger = self.loop.call_later(wait, self.transport.close)

    def _watch_headers(self) -> None:
        """Arm the deadline while a request's headers are incomplete; disarm it once they are in. An idle
        keep-alive connection has uvicorn's own timer (armed after a response, disarmed by the next byte)."""
        incomplete = self.conn.their_state is h11.IDLE and not self.transport.is_closing() and not self._refused
        if not incomplete:
            self._stop_header_timer()
        elif self._header_timer is None and self.timeout_keep_alive_task is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()
