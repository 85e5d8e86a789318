"""Operators' endpoints beside the OpenAI API: GET /metrics (Prometheus), POST /tokenize and /detokenize
(vLLM's bodies; llama-server's `content` is accepted too)."""

from __future__ import annotations

from typing import ClassVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from gpt2edge.serve.api.completions import ready_scheduler
from gpt2edge.serve.api.http import read_body
from gpt2edge.serve.api.protocol import ApiError, parse_body

router = APIRouter()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: one text (a list is a completion's prompt form, not this endpoint's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    hints: ClassVar[dict[str, str]] = {
        "prompt": "prompt must be one string (send one /tokenize request per text).",
        "content": "content must be one string (send one /tokenize request per text).",
    }
    prompt: str | None = None
    content: str | None = None  # llama-server's name for it
    model: str | None = None
    add_special_tokens: bool = True  # accepted for vLLM's clients; GPT-2 adds none


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int] = Field(max_length=1 << 20)
    model: str | None = None


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    config = request.app.state.config
    req = parse_body(await read_body(request, config.max_body_bytes, config.body_timeout_s), TokenizeRequest)
    _check_model(req.model, config.model_name)
    if (req.prompt is None) == (req.content is None):
        raise ApiError(400, "Send the text as prompt (or content), once.", "prompt", "invalid_value")
    scheduler = ready_scheduler(request)
    # a megabyte takes the tokenizer about a second: off the event loop, where other clients wait
    tokens = await anyio.to_thread.run_sync(scheduler.tokenizer.encode, req.prompt if req.prompt is not None else
                                            req.content)  # fmt: skip
    return {"tokens": tokens, "count": len(tokens), "max_model_len": scheduler.n_positions}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    config = request.app.state.config
    req = parse_body(await read_body(request, config.max_body_bytes, config.body_timeout_s), DetokenizeRequest)
    _check_model(req.model, config.model_name)
    scheduler = ready_scheduler(request)
    vocab = int(scheduler.generator.graph.vocab_size)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"Token id {bad[0]} is outside the vocabulary (0..{vocab - 1}).", "tokens", "invalid_value")
    text = scheduler.tokenizer.decode(req.tokens)
    return {"prompt": text, "content": text}


def _check_model(model: str | None, name: str) -> None:
    if model is not None and model != name:
        raise ApiError(404, f"The model '{model}' does not exist here; this server serves '{name}'.", "model",
                       "model_not_found")  # fmt: skip
