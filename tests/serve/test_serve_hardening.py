"""Hostile and unlucky clients: idle and slow sockets, oversized headers, a trickled body, floods, slow readers,
requests during shutdown, a port in use. Each is bounded, answered with a status that says why, and leaves the
server serving others."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")

from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.serve.api.app import drain  # noqa: E402
from gpt2edge.serve.api.events import EventBuffer  # noqa: E402
from gpt2edge.serve.scheduling.jobs import Failure, Piece  # noqa: E402
from tests.support import python_child  # noqa: E402
from tests.support.serve import alone, cli_ready, connect, parse_sse, post, read_all, running  # noqa: E402


def test_idle_and_half_sent_requests_are_timed_out(tiny_export):
    with running(tiny_export, header_timeout_s=0.4, body_timeout_s=0.4) as (url, _):
        idle = connect(url)  # sends nothing
        half_headers = connect(url)
        half_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: applic")
        half_body = connect(url)
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"prompt\":")
        t0 = time.monotonic()
        answers = [read_all(s) for s in (idle, half_headers, half_body)]
        assert time.monotonic() - t0 < 5  # closed by the server, not by the client's 10 s timeout
        assert answers[0].startswith(b"HTTP/1.1 408") and answers[1].startswith(b"HTTP/1.1 408")
        assert answers[2].startswith(b"HTTP/1.1 408") and b"body_timeout" in answers[2]
        # a keep-alive connection whose second request stalls mid-headers is timed out as well
        s = connect(url)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nhost:")
        assert read_all(s).startswith(b"HTTP/1.1 408")
        assert post(url, {"prompt": "A", "max_tokens": 4, "temperature": 0}).json()["choices"][0]["text"] == alone(
            Generator(tiny_export), "A", 4
        )


def test_a_flood_of_idle_connections_cannot_lock_clients_out(tiny_export):
    """Past --max-connections new sockets get 503 and are closed at once; the idle ones time out, so a real
    client gets through within the header deadline."""
    with running(tiny_export, header_timeout_s=0.5, max_connections=8) as (url, _):
        flood = [connect(url) for _ in range(40)]
        refused = [read_all(s) for s in flood[8:]]
        assert all(r.startswith(b"HTTP/1.1 503") for r in refused)
        time.sleep(0.7)  # the 8 admitted idle sockets reach their header deadline
        assert post(url, {"prompt": "a", "max_tokens": 2}).status_code == 200
        for s in flood:
            s.close()


def test_an_oversized_header_is_refused_unread(tiny_export):
    with running(tiny_export, max_header_bytes=16 * 1024) as (url, _):
        s = connect(url)
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (4 << 20) + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the socket before the 4 MB were sent: what we want
        assert read_all(s).startswith(b"HTTP/1.1 431")
        assert post(url, {"prompt": "a", "max_tokens": 2}).status_code == 200


def test_a_flood_beyond_the_queue_gets_429_with_retry_after(tiny_export):
    async def flood(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"prompt": "a", "max_tokens": 20, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

    with running(tiny_export, delay=0.02, max_batch=2, max_queue=2) as (url, _):
        results = asyncio.run(flood(url))
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429} and codes.count(200) >= 2  # the queue's 2, and any admitted before them
    assert all(r.headers["retry-after"] == "1" for r in results if r.status_code == 429)


def test_requests_during_shutdown_get_503(tiny_export):
    with running(tiny_export) as (url, scheduler):
        client = httpx.Client(base_url=url, timeout=30)
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
        app_state = type("App", (), {"state": type("S", (), {"scheduler": scheduler})})
        drain(app_state)  # what SIGTERM / Ctrl-C does first
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "shutting_down"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"


def test_a_slow_reader_is_dropped_with_an_error_event(tiny_export, monkeypatch):
    """A client that stops reading: its events pile up to the bound, then its row is freed and the stream ends
    with an error event after what it had not read. (The server's socket gets a small send buffer, as on a slow
    link: on loopback the kernel would otherwise absorb this tiny model's whole stream.)"""
    from gpt2edge.serve.hosting.limits import LimitedH11Protocol

    made = LimitedH11Protocol.connection_made

    def small_send_buffer(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        made(self, transport)

    monkeypatch.setattr(LimitedH11Protocol, "connection_made", small_send_buffer)
    with running(tiny_export, max_buffered_events=8, max_batch=8) as (url, scheduler):
        s = connect(url, rcvbuf=2048)
        body = (b'{"prompt": "The city", "n": 8, "max_tokens": 100, "ignore_eos": true, "logprobs": 5, '
                b'"stream": true}')  # fmt: skip
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
        deadline = time.monotonic() + 30
        while scheduler.stats()["dropped_rows"] < 8 and time.monotonic() < deadline:
            time.sleep(0.05)  # nothing read meanwhile
        stats = scheduler.stats()
        raw = read_all(s).decode(errors="replace")
        assert stats["dropped_rows"] == 8 and stats["running"] == 0
        assert '"code": "slow_reader"' in raw and "[DONE]" not in raw
        assert post(url, {"prompt": "a", "max_tokens": 2}).status_code == 200


def test_event_buffer_bounds_what_waits_for_the_client():
    loop = asyncio.new_event_loop()
    buffer = EventBuffer(loop, limit=3)
    cancelled = threading.Event()
    buffer.job = type("J", (), {"cancel": cancelled.set})()
    for i in range(10):  # the scheduler thread's side
        buffer.emit(Piece(0, str(i), None, i))
    loop.run_until_complete(asyncio.sleep(0))
    got = [loop.run_until_complete(buffer.get()) for _ in range(buffer.qsize())]
    loop.close()
    assert [e.text for e in got[:3]] == ["0", "1", "2"] and len(got) == 4
    assert isinstance(got[3], Failure) and got[3].code == "slow_reader" and cancelled.is_set()


def _cli(*args: str) -> subprocess.Popen:
    return python_child("-m", "gpt2edge.cli", "serve", *args)


def test_a_port_in_use_is_one_error_line_before_the_model_loads(tiny_export):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _cli(str(tiny_export), "--port", str(port))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert err.strip().splitlines() == [
        f"error: Cannot listen on 127.0.0.1:{port}: Address already in use; pass another --port."
    ]


def test_a_warning_while_the_server_loads_is_one_warning_line(tiny_export, tmp_path, monkeypatch):
    # the optimized-graph cache warns from the scheduler's load thread (here: a cache limit that is not a size);
    # serve prints it as the other commands do, one `warning:` line, not Python's two lines with a source path
    folder = Path(shutil.copytree(tiny_export, tmp_path / "tiny"))
    for f in folder.iterdir():  # settled files (a graph written in the last 2 s is not cached: graph_cache.py)
        os.utime(f, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv("GPT2EDGE_CACHE_DIR", str(tmp_path / "cache"))  # empty: the graph is saved, then pruned
    monkeypatch.setenv("GPT2EDGE_GRAPH_CACHE_BYTES", "lots")
    proc = _cli(str(folder), "--port", "0")
    try:
        cli_ready(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    lines = proc.stderr.read().splitlines()
    warned = [line for line in lines if "GPT2EDGE_GRAPH_CACHE_BYTES" in line]
    assert warned == ["warning: GPT2EDGE_GRAPH_CACHE_BYTES='lots' is not a size (e.g. 8G); using 16G"], lines
    assert not any("RuntimeWarning" in line or "warnings.warn" in line for line in lines), lines


def test_sigterm_finishes_running_streams_then_exits_0(tiny_export):
    proc = _cli(str(tiny_export), "--port", "0", "--model-name", "tiny", "--shutdown-timeout", "20")
    try:
        url = cli_ready(proc, tries=200)
        body = {"prompt": "a", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json=body) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)  # mid-stream
            events = parse_sse([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert rc == 0, stderr
    assert '"event": "access"' in stderr  # the structured access log


def test_the_connection_cap_stays_below_the_file_descriptor_limit(monkeypatch):
    """With `ulimit -n 512`, 512 connections would leave no descriptor for accept(): the cap keeps 64 spare."""
    import resource

    from gpt2edge.serve.hosting.server import connection_cap

    monkeypatch.setattr(resource, "getrlimit", lambda what: (512, 512))
    assert connection_cap(512) == 448 and connection_cap(100) == 100
