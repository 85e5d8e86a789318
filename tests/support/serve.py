"""The serve room's helpers (tests/serve/ and the runtime tests that compare with the server): a real uvicorn
server on a thread, a slowed scheduler to leave mid-stream, HTTP and SSE clients, and the runtime's text alone."""

from __future__ import annotations

import json
import re
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")

from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.api.app import create_app  # noqa: E402
from gpt2edge.serve.hosting.server import BackgroundServer  # noqa: E402
from gpt2edge.serve.scheduling.continuous import ContinuousScheduler  # noqa: E402
from gpt2edge.serve.scheduling.scheduler import Scheduler  # noqa: E402

PROMPTS = [
    "The river rose and",
    "Children learned to swim before they could read, and the",
    "A",
    "Visitors walk along the old harbour wall at dusk while",
    "",
    "The city",
    "Snow fell on the quiet hills",
    "Über café – naïve résumé",
]
GREEDY = dict(min_new_tokens=0, top_k=0, repetition_penalty=1.0, do_sample=False)


class SlowGenerator(Generator):
    """A Generator whose decode steps take at least `delay` seconds, so a test can leave mid-stream."""

    delay = 0.0

    def generate(self, prompt, *, callback=None, **kw):
        def slow(step):
            time.sleep(self.delay)
            if callback is not None:
                callback(step)

        return super().generate(prompt, callback=slow, **kw)


class SlowContinuous(ContinuousScheduler):
    """A continuous scheduler whose decode steps take at least `delay` seconds."""

    delay = 0.0

    def _run_next(self) -> bool:
        time.sleep(self.delay)
        return super()._run_next()


@contextmanager
def running(model_dir: Path, delay: float = 0.0, **limits):
    """A real uvicorn server on a thread (continuous batching unless scheduler="next-batch"); yields
    (url, scheduler); stopped on exit."""
    config = ServeConfig(model_name="tiny", **limits)
    if config.scheduler == "continuous":
        scheduler = SlowContinuous(Generator(model_dir), config)
        scheduler.delay = delay
    else:
        gen = SlowGenerator(model_dir)
        gen.delay = delay
        scheduler = Scheduler(gen, config)
    with BackgroundServer(create_app(lambda: scheduler, config)) as url:
        yield url, scheduler


def alone(gen: Generator, prompt: str, max_tokens: int, stop=(), ignore_eos=False) -> str:
    return gen.generate(prompt, max_new_tokens=max_tokens, stop=list(stop), ignore_eos=ignore_eos, **GREEDY).text


def post(url: str, body, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + "/v1/completions", content=content, timeout=timeout)


def parse_sse(lines) -> list:
    """The `data:` payloads of an event stream, JSON-decoded ("[DONE]" kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def joined(events: list) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts


async def stream_one(client: httpx.AsyncClient, body: dict, leave_after: int | None = None) -> list:
    """Stream a completion; with leave_after, close the connection after that many events."""
    events = []
    async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line:
                events += parse_sse([line])
                if leave_after is not None and len(events) >= leave_after:
                    return events
    return events


def cli_ready(proc, tries: int = 400) -> str:
    """The URL a `gpt2edge serve` child prints on its first stdout line, once its /health says 200 (wait_ready)."""
    url = re.search(r"on (http://127\.0\.0\.1:\d+)", proc.stdout.readline()).group(1)
    wait_ready(url, tries)
    return url


def wait_ready(url: str, tries: int = 400) -> None:
    """Return once the server's /health says 200 (the model loaded), polled every 50 ms up to `tries` times."""
    for _ in range(tries):
        if httpx.get(url + "/health", timeout=10).status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"{url}/health did not answer 200 within {tries * 0.05:.0f} s")


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        if (h["waiting"], h["running"]) == (0, 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    """A raw socket to the server (the hostile-client tests send bytes by hand)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    s.settimeout(10)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out
