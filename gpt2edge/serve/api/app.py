"""The FastAPI app: OpenAI-compatible /v1/completions and /v1/chat/completions (plain or SSE), /v1/models, and
the operators' endpoints (/health, /metrics, /tokenize, /detokenize, llama-server's /slots).

The app does no model work: it checks a request, hands it to the scheduler as a Job, and turns the Job's events
(delivered onto this event loop from the scheduler thread) into a response. With background=True the model
loads while the server already answers: /health says "loading" (503) until it is ready.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gpt2edge import __version__
from gpt2edge.serve.api.access import AccessMiddleware
from gpt2edge.serve.api.chat import router as chat_router
from gpt2edge.serve.api.chat_template import TemplateSandbox
from gpt2edge.serve.api.completions import ready_scheduler
from gpt2edge.serve.api.completions import router as completions_router
from gpt2edge.serve.api.http import error_response
from gpt2edge.serve.api.metrics import Metrics
from gpt2edge.serve.api.ops import router as ops_router
from gpt2edge.serve.api.protocol import ApiError
from gpt2edge.serve.api.slots import router as slots_router
from gpt2edge.serve.config import ServeConfig
from gpt2edge.serve.scheduling.scheduler import Scheduler

log = logging.getLogger("gpt2edge.serve")


def create_app(
    load: Callable[[], Scheduler],
    config: ServeConfig,
    background: bool = False,
    on_load_error: Callable[[str], None] | None = None,
) -> FastAPI:
    """`load` builds the Scheduler (and its Generator) when the server starts: in this process, or in each
    Ray Serve replica. background: load on a thread while the server answers (on_load_error gets the message
    of a load that failed; the CLI then stops the server)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if background:
            threading.Thread(target=_load, args=(app, load, on_load_error), name="gpt2edge-load", daemon=True).start()
        else:
            _ready(app, await anyio.to_thread.run_sync(load))
        try:
            yield
        finally:
            app.state.templates.close()
            scheduler = app.state.scheduler
            if scheduler is not None:
                await anyio.to_thread.run_sync(scheduler.stop)

    app = FastAPI(title="gpt2edge", version=__version__, lifespan=lifespan)
    app.state.config = config
    app.state.scheduler = None
    app.state.load_error = None
    app.state.started = int(time.time())
    app.state.metrics = Metrics(app)
    app.state.templates = TemplateSandbox(config.template_timeout_s)  # its process starts at the first chat request
    app.add_middleware(AccessMiddleware, config=config, metrics=app.state.metrics)
    app.add_exception_handler(ApiError, lambda request, e: error_response(e))
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(completions_router)
    app.include_router(chat_router)
    app.include_router(ops_router)
    app.include_router(slots_router)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        state = request.app.state
        if state.load_error is not None:
            return JSONResponse({"status": "error", "model": config.model_name, "message": state.load_error}, 503)
        if state.scheduler is None:
            return JSONResponse({"status": "loading", "model": config.model_name}, 503)
        stats = state.scheduler.stats()
        status = "shutting_down" if stats["draining"] else "ok"
        return JSONResponse({"status": status, "model": config.model_name, **stats}, 503 if stats["draining"] else 200)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [_model_card(request, config)]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict:
        if model != config.model_name:
            raise ApiError(404, f"The model '{model}' does not exist here.", "model", "model_not_found")
        return _model_card(request, config)

    return app


def _ready(app: FastAPI, scheduler: Scheduler) -> None:
    if scheduler.head is not None:
        log.warning("%s has an approximate LM head (%s): its text is not the model's distribution",
                    app.state.config.model_name, scheduler.head)  # fmt: skip
    scheduler.start()
    app.state.scheduler = scheduler


def _load(app: FastAPI, load: Callable[[], Scheduler], on_error: Callable[[str], None] | None) -> None:
    try:
        _ready(app, load())
        log.info("model %s loaded", app.state.config.model_name)
    except Exception as e:  # reported by /health and, through on_error, by the CLI's one error line
        app.state.load_error = str(e) or type(e).__name__
        log.error("loading the model failed: %s", app.state.load_error)
        if on_error is not None:
            on_error(app.state.load_error)


def drain(app) -> None:
    """Shutdown has begun: new requests get 503, running ones go on until the server's graceful timeout."""
    state = getattr(app, "state", None)
    scheduler = getattr(state, "scheduler", None)
    if scheduler is not None:
        scheduler.drain()


def abort(app) -> None:
    """The graceful time is spent: every job still queued or decoding ends now with an error event, so its
    stream closes whole (an error event, not a cut) before the server cancels what is left. Blocks briefly."""
    scheduler = getattr(getattr(app, "state", None), "scheduler", None)
    if scheduler is not None:
        scheduler.stop()


def _model_card(request: Request, config: ServeConfig) -> dict:
    scheduler = ready_scheduler(request)
    card = {
        "id": config.model_name,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "gpt2edge",
        "max_model_len": scheduler.n_positions,
    }
    if scheduler.head is not None:  # sparse-head --mode cluster: its rows are not the model's log-probs
        card["approximate_head"] = scheduler.head
    return card


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(ApiError(e.status_code, f"{e.detail}: {request.method} {request.url.path}", None, code))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    message = f"Internal error ({type(e).__name__}); the server is still running."
    return error_response(ApiError(500, message, None, "internal_error", "server_error"))
