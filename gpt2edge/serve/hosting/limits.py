"""What uvicorn's h11 protocol lacks against idle and slow clients: a deadline for a request's headers and a
hard cap on open connections. (Header size: h11's max_incomplete_event_size; a body's deadline: http.read_body;
idle keep-alive connections: uvicorn's timeout_keep_alive. All set from ServeConfig in server.py.)

Without them, connections that send nothing or half their headers are never closed: a few hundred such sockets
exhaust the process's file descriptors and lock every other client out.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
BUSY_RESPONSE = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def limited_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class with these limits (uvicorn.Config(http=...) takes the class)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "max_connections": max_connections,
    })  # fmt: skip


class LimitedH11Protocol(H11Protocol):
    header_timeout_s = 10.0  # from connecting, or from a request's first byte, to its last header
    max_connections = 512  # open connections; one more is answered 503 and closed at once

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Arm the deadline while a request's headers are incomplete; disarm it once they are in. An idle
        keep-alive connection has uvicorn's own timer (armed after a response, disarmed by the next byte)."""
        incomplete = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
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
