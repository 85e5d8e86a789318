"""Running the app on uvicorn: in the foreground (the CLI) or on a background thread (tests, notebooks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from gpt2edge.errors import ServeError
from gpt2edge.serve.app import create_app
from gpt2edge.serve.config import ServeConfig
from gpt2edge.serve.scheduler import Scheduler

GRACEFUL_SHUTDOWN_S = 5  # open streams get this long to finish before they are cut (and their rows freed)


def local_app(
    model_dir: str | Path, config: ServeConfig, device: str = "cpu", threads: int | None = None, verify: bool = True
) -> FastAPI:
    """Load the model now (a bad folder fails here, before any port is bound) and wrap it in the app."""
    scheduler = Scheduler.load(model_dir, config, device=device, threads=threads, verify=verify)
    return create_app(lambda: scheduler, config)


class _Server(uvicorn.Server):
    """uvicorn.Server that reports the address it bound (port 0 means any free port)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str], None] | None = None) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self.url = ""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.url = f"http://{host}:{port}"
            if self._on_ready is not None:
                self._on_ready(self.url)


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on"
    )


def serve_forever(
    app: FastAPI, host: str, port: int, on_ready: Callable[[str], None] | None = None, log_level: str = "info"
) -> None:
    """Serve until Ctrl-C / SIGTERM (uvicorn handles both and shuts down gracefully)."""
    server = _Server(_uvicorn_config(app, host, port, log_level), on_ready)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down
        pass
    if not server.started:
        raise ServeError(f"Could not start the server on {host}:{port} (port in use?); pass another --port.")


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

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(self._timeout)
