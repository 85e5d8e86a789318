"""Running the app on uvicorn: in the foreground (the CLI) or on a background thread (tests, notebooks).

The port is bound before the model loads (a port in use is one `error:` line, not a lost minute and uvicorn's
exit 3). uvicorn runs with the limits of ServeConfig: header and body deadlines, a connection cap, a header
size cap and a keep-alive timeout (serve/hosting/limits.py says what each guards against). On SIGTERM or Ctrl-C it stops
accepting, requests that still arrive get 503, running rows get shutdown_timeout_s to finish, the rest are
cancelled, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from gpt2edge.errors import ServeError
from gpt2edge.serve.api.app import abort, create_app, drain
from gpt2edge.serve.config import ServeConfig
from gpt2edge.serve.hosting.limits import limited_protocol
from gpt2edge.serve.hosting.startup import SchedulerLoading, log_lines
from gpt2edge.serve.scheduling.continuous import load_scheduler

ABORT_S = 2.0  # after --shutdown-timeout: the time running streams get to send their error event and close


def local_app(
    model_dir: str | Path, config: ServeConfig, device: str = "cpu", threads: int | None = None, verify: bool = True
) -> FastAPI:
    """Load the model now (a bad folder fails here, before any request) and wrap it in the app."""
    scheduler = load_scheduler(model_dir, config, device=device, threads=threads, verify=verify)
    return create_app(lambda: scheduler, config)


def loading_app(scheduling: SchedulerLoading, config: ServeConfig, on_error: Callable[[str], None]) -> FastAPI:
    """An app whose scheduler is `scheduling`'s (its folder checked, its build under way since before the server's
    imports): the server answers /health with "loading" until it is built; a failed build goes to on_error."""
    return create_app(scheduling.result, config, background=True, on_load_error=on_error)


class _Server(uvicorn.Server):
    """uvicorn.Server that reports the address it bound (port 0 means any free port), turns new requests away
    (503) as soon as shutdown starts, and exits 0 on SIGTERM (uvicorn re-raises the signal it handled)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str], None] | None = None) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self.url = ""
        self._abort_after_s = max(0.0, config.timeout_graceful_shutdown - ABORT_S) + 0.1  # uvicorn first waits 0.1 s

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.url = f"http://{host}:{port}"
            if self._on_ready is not None:
                self._on_ready(self.url)

    def handle_exit(self, sig: int, frame) -> None:
        drain(self.config.app)
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # a service manager's stop: a clean exit once shut down, not death by signal
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    def request_exit(self) -> None:
        drain(self.config.app)
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's graceful shutdown, except that when --shutdown-timeout is spent the running jobs are ended
        with an error event first (abort), so streams close whole and no request task is cancelled mid-write
        (which cut streams and logged a CancelledError traceback each). uvicorn's own deadline comes ABORT_S
        later, for what abort could not end."""
        graceful = asyncio.ensure_future(super().shutdown(sockets))
        done, _ = await asyncio.wait({graceful}, timeout=self._abort_after_s)
        if not done:
            await asyncio.to_thread(abort, self.config.app)
        await graceful


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    limits: ServeConfig = app.state.config
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=limited_protocol(limits.header_timeout_s, connection_cap(limits.max_connections), limits.max_header_bytes),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=limits.shutdown_timeout_s + ABORT_S,
        access_log=False,  # the app writes its own structured access log (request ids, timings)
    )


def connection_cap(asked: int) -> int:
    """--max-connections, lowered to leave 64 file descriptors of the process's limit (ulimit -n) for the model,
    logs and the listening socket: past the limit accept() fails and nobody gets in."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return asked if soft == resource.RLIM_INFINITY else max(1, min(asked, soft - 64))


def serve_forever(
    make_app: Callable[[Callable[[str], None]], FastAPI],
    sock: socket.socket,
    on_ready: Callable[[str], None] | None = None,
    log_level: str = "info",
) -> None:
    """Serve on a bound socket until Ctrl-C / SIGTERM; then shut down gracefully. make_app(on_load_error) builds
    the app; a load that fails stops the server and is raised here as one ServeError."""
    log_lines()
    host, port = sock.getsockname()[:2]
    failed: list[str] = []
    holder: list[_Server] = []

    def on_load_error(message: str) -> None:
        failed.append(message)
        holder[0].request_exit()

    app = make_app(on_load_error)
    server = _Server(_uvicorn_config(app, host, port, log_level), on_ready)
    holder.append(server)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down
        pass
    if failed:
        raise ServeError(f"Could not load the model: {failed[0]}")
    if not server.started:
        raise ServeError(f"The server on {host}:{port} did not start; see the log above.")


class BackgroundServer:
    """`with BackgroundServer(app) as url:` serves on 127.0.0.1 (a free port) on a thread; stops on exit."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> None:
        self._server = _Server(_uvicorn_config(app, host, port, "warning"))
        self._thread = threading.Thread(target=self._server.run, name="gpt2edge-uvicorn", daemon=True)
        self._timeout = timeout

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            raise ServeError("The background server did not start; see its log above.")
        return self._server.url

    def stop(self) -> None:
        """Begin a graceful shutdown (returns at once; __exit__ waits for it)."""
        self._server.request_exit()

    def __exit__(self, *exc) -> None:
        self._server.request_exit()
        self._thread.join(self._timeout)
