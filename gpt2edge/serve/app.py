"""The FastAPI app: OpenAI-compatible /v1/completions (plain or SSE), /v1/models, /health.

The app does no model work: it checks a request, hands it to the scheduler as a Job, and turns the Job's events
(delivered onto this event loop from the scheduler thread) into a response.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from gpt2edge import __version__
from gpt2edge.serve.config import ServeConfig
from gpt2edge.serve.http import SSEResponse, error_response, read_body, wait_disconnect
from gpt2edge.serve.jobs import Failure, Job, Piece
from gpt2edge.serve.logprobs import TokenEntry, logprobs_body
from gpt2edge.serve.plan import Plan, plan_request
from gpt2edge.serve.protocol import ApiError, chunk_body, completion_body, parse_request, sse, usage_body
from gpt2edge.serve.scheduler import QueueFull, Scheduler, ServerClosed


@dataclass(frozen=True)
class Meta:
    """What every body and chunk of one response repeats."""

    cid: str
    created: int
    model: str


def create_app(load: Callable[[], Scheduler], config: ServeConfig) -> FastAPI:
    """`load` builds the Scheduler (and its Generator) when the server starts: in this process, or in each
    Ray Serve replica."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler = await anyio.to_thread.run_sync(load)
        scheduler.start()
        app.state.scheduler = scheduler
        app.state.started = int(time.time())
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(scheduler.stop)

    app = FastAPI(title="gpt2edge", version=__version__, lifespan=lifespan)
    app.add_exception_handler(ApiError, lambda request, e: error_response(e))
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    @app.get("/health")
    async def health(request: Request) -> dict:
        return {"status": "ok", "model": config.model_name, **request.app.state.scheduler.stats()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [_model_card(request, config)]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict:
        if model != config.model_name:
            raise ApiError(404, f"The model '{model}' does not exist here.", "model", "model_not_found")
        return _model_card(request, config)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        scheduler: Scheduler = request.app.state.scheduler
        req = parse_request(await read_body(request, config.max_body_bytes))
        tok = scheduler.tokenizer
        # encoding a long prompt takes milliseconds: off the event loop
        plan = await anyio.to_thread.run_sync(
            plan_request, req, config, scheduler.n_positions, scheduler.encode, scheduler.max_rows
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:  # called on the scheduler thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: the server stopped, nobody is waiting
                pass

        job = Job(
            plan.prompts, plan.prompt_lens, plan.n, plan.max_tokens, plan.sampling, plan.stop, emit, tok, plan.logprobs,
            plan.prompt_ids,
        )
        try:
            _submit(scheduler, job)
        except QueueFull:
            raise ApiError(
                429,
                f"The server is busy ({config.max_queue} requests already queued); retry shortly.",
                None,
                "queue_full",
                "rate_limit_error",
            ) from None
        except ServerClosed:
            raise ApiError(503, "The server is shutting down.", None, "shutting_down", "server_error") from None
        meta = Meta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), config.model_name)
        if plan.stream:
            return SSEResponse(_stream(job, events, plan, meta), on_close=job.cancel)
        return await _collect(request, job, events, plan, meta)

    return app


def _submit(scheduler: Scheduler, job: Job) -> None:
    """Queue the job; max_tokens 0 (allowed with echo only) decodes nothing: every choice ends at once."""
    if job.max_tokens > 0:
        scheduler.submit(job)
        return
    for row in job.rows:
        row.done = True
        job.emit(Piece(row.choice, "", "length", 0))


def _logprobs(plan: Plan, entries: list[TokenEntry] | None) -> dict | None:
    """A choice's (or a chunk's) `logprobs` object: null unless the request asked for logprobs."""
    return None if plan.logprobs is None else logprobs_body(entries or [], plan.logprobs)


def _model_card(request: Request, config: ServeConfig) -> dict:
    return {
        "id": config.model_name,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "gpt2edge",
        "max_model_len": request.app.state.scheduler.n_positions,
    }


def _failed(event: Failure) -> ApiError:
    return ApiError(500, event.message, None, "generation_failed", "server_error")


async def _stream(job: Job, events: asyncio.Queue, plan: Plan, meta: Meta) -> AsyncIterator[bytes]:
    """SSE events: one chunk per new piece of a choice, the usage chunk if asked, then [DONE]."""
    try:
        if plan.echo:
            for row in job.rows:
                yield sse(chunk_body(meta.cid, meta.created, meta.model, row.choice, row.prompt, None))
        left, completion_tokens = len(job.rows), 0
        while left:
            event = await events.get()
            if isinstance(event, Failure):
                yield sse(_failed(event).body())
                return
            lp = _logprobs(plan, event.logprobs)
            yield sse(chunk_body(meta.cid, meta.created, meta.model, event.choice, event.text, event.finish_reason, lp))
            if event.finish_reason is not None:
                left, completion_tokens = left - 1, completion_tokens + event.completion_tokens
        if plan.include_usage:
            usage = usage_body(sum(plan.prompt_lens), completion_tokens)
            yield sse({"id": meta.cid, "object": "text_completion", "created": meta.created, "model": meta.model,
                       "choices": [], "usage": usage})  # fmt: skip
        yield sse("[DONE]")
    finally:
        job.cancel()  # a no-op once every row is done; otherwise frees the rows of a client that left


async def _gather(job: Job, events: asyncio.Queue) -> tuple[list[str], list[str], list[list[TokenEntry]], int]:
    texts, reasons = [""] * len(job.rows), [""] * len(job.rows)
    tokens: list[list[TokenEntry]] = [[] for _ in job.rows]
    left, completion_tokens = len(job.rows), 0
    while left:
        event = await events.get()
        if isinstance(event, Failure):
            raise _failed(event)
        texts[event.choice] += event.text
        tokens[event.choice] += event.logprobs or []
        if event.finish_reason is not None:
            reasons[event.choice] = event.finish_reason
            left, completion_tokens = left - 1, completion_tokens + event.completion_tokens
    return texts, reasons, tokens, completion_tokens


async def _collect(request: Request, job: Job, events: asyncio.Queue, plan: Plan, meta: Meta) -> Response:
    """Wait for every choice, or for the client to leave (then its rows are freed and nobody gets an answer)."""
    result = asyncio.ensure_future(_gather(job, events))
    gone = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
        job.cancel()
    if not result.done() or result.cancelled():
        return Response(status_code=499)  # client closed the request; nobody reads this
    texts, reasons, tokens, completion_tokens = result.result()  # raises the ApiError of a failed batch
    if plan.echo:
        texts = [plan.prompts[i // plan.n] + t for i, t in enumerate(texts)]
    usage = usage_body(sum(plan.prompt_lens), completion_tokens)
    blocks = None if plan.logprobs is None else [_logprobs(plan, t) for t in tokens]
    return JSONResponse(completion_body(meta.cid, meta.created, meta.model, texts, reasons, usage, blocks))


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(ApiError(e.status_code, f"{e.detail}: {request.method} {request.url.path}", None, code))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    message = f"Internal error ({type(e).__name__}); the server is still running."
    return error_response(ApiError(500, message, None, "internal_error", "server_error"))
