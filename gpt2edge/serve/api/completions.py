"""POST /v1/completions (and the machinery /v1/chat/completions shares): a checked request becomes a Job on the
scheduler; the Job's events become a JSON body, or SSE chunks as they arrive."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gpt2edge.serve.api.events import EventBuffer
from gpt2edge.serve.api.http import SSEResponse, read_body, shutting_down, wait_disconnect
from gpt2edge.serve.api.plan import Plan, plan_request
from gpt2edge.serve.api.protocol import ApiError, chunk_body, completion_body, parse_request, sse, usage_body
from gpt2edge.serve.config import MAX_LOGPROBS, ServeConfig
from gpt2edge.serve.scheduling.jobs import Failure, Job, Piece
from gpt2edge.serve.scheduling.logprobs import TokenEntry, logprobs_body
from gpt2edge.serve.scheduling.scheduler import QueueFull, Scheduler, ServerClosed

RETRY_AFTER_S = 1  # a 429's Retry-After: a decode step frees rows within well under a second


@dataclass(frozen=True)
class Meta:
    """What every body and chunk of one response repeats."""

    cid: str
    created: int
    model: str


class Shape(Protocol):
    """How one endpoint spells its bodies (text completions, chat completions)."""

    prefix: str
    obj: str  # the object name of the final usage chunk
    max_logprobs: int  # the most alternatives per token the endpoint reports (OpenAI: 5 for text, 20 for chat)

    def logprobs(self, plan: Plan, entries: list[TokenEntry] | None) -> dict | None: ...

    def chunk(self, meta: Meta, choice: int, text: str, reason: str | None, lp: dict | None) -> dict: ...

    def body(self, meta: Meta, texts: list[str], reasons: list[str], usage: dict, lps: list | None) -> dict: ...


class TextShape:
    prefix, obj = "cmpl", "text_completion"
    max_logprobs = MAX_LOGPROBS

    def logprobs(self, plan: Plan, entries: list[TokenEntry] | None) -> dict | None:
        """A choice's (or a chunk's) `logprobs` object: null unless the request asked for logprobs."""
        return None if plan.logprobs is None else logprobs_body(entries or [], plan.logprobs)

    def chunk(self, meta: Meta, choice: int, text: str, reason: str | None, lp: dict | None) -> dict:
        return chunk_body(meta.cid, meta.created, meta.model, choice, text, reason, lp)

    def body(self, meta: Meta, texts: list[str], reasons: list[str], usage: dict, lps: list | None) -> dict:
        return completion_body(meta.cid, meta.created, meta.model, texts, reasons, usage, lps)


router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    config: ServeConfig = request.app.state.config
    req = parse_request(await read_body(request, config.max_body_bytes, config.body_timeout_s))
    return await respond(request, req, TextShape())


def ready_scheduler(request: Request) -> Scheduler:
    """The scheduler, or 503 while the model loads or the server shuts down."""
    scheduler = request.app.state.scheduler
    if scheduler is None:
        raise ApiError(503, "The model is still loading; retry shortly (GET /health says when it is ready).", None,
                       "loading", "server_error", {"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
    return scheduler


async def respond(request: Request, req: Any, shape: Shape, prompt_override: list[str] | None = None) -> Response:
    """Plan, queue and answer a parsed request (prompt_override: the prompts a chat template rendered)."""
    config: ServeConfig = request.app.state.config
    scheduler = ready_scheduler(request)
    # encoding a long prompt takes milliseconds: off the event loop
    plan: Plan = await anyio.to_thread.run_sync(plan_request, req, config, scheduler.limits(), prompt_override,
                                                shape.max_logprobs)  # fmt: skip
    events = EventBuffer(asyncio.get_running_loop(), config.max_buffered_events)
    job = Job(
        plan.prompts, plan.prompt_lens, plan.n, plan.max_tokens, plan.sampling, plan.stop, events.emit,
        scheduler.tokenizer, plan.logprobs, plan.prompt_ids, metrics=request.app.state.metrics,
        request_id=request.state.request_id, constraint=plan.constraint,
    )  # fmt: skip
    request.app.state.metrics.prompt_tokens.inc(sum(plan.prompt_lens))
    events.job = job
    request.state.job = job
    try:
        _submit(scheduler, job)
    except QueueFull:
        raise ApiError(
            429,
            f"The server is busy ({config.max_queue} requests already queued); retry shortly.",
            None,
            "queue_full",
            "rate_limit_error",
            {"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except ServerClosed:
        raise shutting_down() from None
    meta = Meta(f"{shape.prefix}-{uuid.uuid4().hex}", int(time.time()), config.model_name)
    if plan.stream:
        return SSEResponse(_stream(job, events, plan, meta, shape), on_close=job.cancel)
    return await _collect(request, job, events, plan, meta, shape)


def _submit(scheduler: Scheduler, job: Job) -> None:
    """Queue the job; max_tokens 0 (allowed with echo only) decodes nothing: every choice ends at once."""
    if job.max_tokens > 0:
        scheduler.submit(job)
        return
    for row in job.rows:
        row.done = True
        job.emit(Piece(row.choice, "", "length", 0))


def failed(event: Failure) -> ApiError:
    status = 503 if event.code == "shutting_down" else 500  # a shutdown is worth retrying elsewhere
    return ApiError(status, event.message, None, event.code, "server_error")


async def _stream(job: Job, events: EventBuffer, plan: Plan, meta: Meta, shape: Shape) -> AsyncIterator[bytes]:
    """SSE events: one chunk per new piece of a choice, the usage chunk if asked, then [DONE]."""
    try:
        if plan.echo:
            for row in job.rows:
                yield sse(shape.chunk(meta, row.choice, row.prompt, None, None))
        left, completion_tokens = len(job.rows), 0
        while left:
            event = await events.get()
            if isinstance(event, Failure):
                yield sse(failed(event).body())
                return
            lp = shape.logprobs(plan, event.logprobs)
            yield sse(shape.chunk(meta, event.choice, event.text, event.finish_reason, lp))
            if event.finish_reason is not None:
                left, completion_tokens = left - 1, completion_tokens + event.completion_tokens
        if plan.include_usage:
            usage = usage_body(sum(plan.prompt_lens), completion_tokens, job.cached_tokens)
            yield sse({"id": meta.cid, "object": shape.obj, "created": meta.created, "model": meta.model,
                       "choices": [], "usage": usage})  # fmt: skip
        yield sse("[DONE]")
    finally:
        job.cancel()  # a no-op once every row is done; otherwise frees the rows of a client that left


async def _gather(job: Job, events: EventBuffer) -> tuple[list[str], list[str], list[list[TokenEntry]], int]:
    texts, reasons = [""] * len(job.rows), [""] * len(job.rows)
    tokens: list[list[TokenEntry]] = [[] for _ in job.rows]
    left, completion_tokens = len(job.rows), 0
    while left:
        event = await events.get()
        if isinstance(event, Failure):
            raise failed(event)
        texts[event.choice] += event.text
        tokens[event.choice] += event.logprobs or []
        if event.finish_reason is not None:
            reasons[event.choice] = event.finish_reason
            left, completion_tokens = left - 1, completion_tokens + event.completion_tokens
    return texts, reasons, tokens, completion_tokens


async def _collect(request: Request, job: Job, events: EventBuffer, plan: Plan, meta: Meta, shape: Shape) -> Response:
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
    usage = usage_body(sum(plan.prompt_lens), completion_tokens, job.cached_tokens)
    blocks = None if plan.logprobs is None else [shape.logprobs(plan, t) for t in tokens]
    return JSONResponse(shape.body(meta, texts, reasons, usage, blocks))
