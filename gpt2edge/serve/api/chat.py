"""POST /v1/chat/completions for folders whose tokenizer carries a chat template (e.g. DialoGPT-style).

The template is rendered as transformers' apply_chat_template renders it, in a bounded process of its own, off
the event loop (chat_template.py says where it comes from and what bounds it). A folder with none gets a 400
that says so. The rendered prompt is then an ordinary completion request.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from gpt2edge.serve.api.chat_template import ChatTemplate, TemplateSandbox
from gpt2edge.serve.api.completions import Meta, ready_scheduler, respond
from gpt2edge.serve.api.http import read_body
from gpt2edge.serve.api.plan import Plan, template_output_cap
from gpt2edge.serve.api.protocol import ApiError, CompletionRequest, SamplingFields, StreamOptions, parse_body
from gpt2edge.serve.config import MAX_TOP_LOGPROBS, ServeConfig
from gpt2edge.serve.scheduling.logprobs import FLOOR, TokenEntry

router = APIRouter()
_ROLES = ("system", "user", "assistant", "tool", "developer")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str = Field(max_length=1 << 20)
    name: str | None = None


class ChatRequest(SamplingFields):
    """OpenAI's chat request: the completion request's sampling fields, and messages in place of a prompt."""

    messages: list[Message] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI's chat cap (completions': 5)


class ChatShape:
    prefix, obj = "chatcmpl", "chat.completion.chunk"
    max_logprobs = MAX_TOP_LOGPROBS

    def logprobs(self, plan: Plan, entries: list[TokenEntry] | None) -> dict | None:
        """Chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
        if plan.logprobs is None:
            return None
        return {"content": [_chat_entry(e, plan.logprobs) for e in entries or []]}

    def chunk(self, meta: Meta, choice: int, text: str, reason: str | None, lp: dict | None) -> dict:
        delta = {"role": "assistant", "content": text}
        return {"id": meta.cid, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
                "choices": [{"index": choice, "delta": delta, "logprobs": lp, "finish_reason": reason}]}  # fmt: skip

    def body(self, meta: Meta, texts: list[str], reasons: list[str], usage: dict, lps: list | None) -> dict:
        blocks = lps if lps is not None else [None] * len(texts)
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp, "finish_reason": r}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, blocks))]  # fmt: skip
        return {"id": meta.cid, "object": "chat.completion", "created": meta.created, "model": meta.model,
                "choices": choices, "usage": usage}  # fmt: skip


def _bytes(name: str) -> list[int]:
    if name.startswith("bytes:"):
        return list(bytes(int(h, 16) for h in name[len("bytes:") :].split("\\x")[1:]))
    return [] if name.startswith("<|id:") else list(name.encode())


def _chat_entry(e: TokenEntry, n: int) -> dict[str, Any]:
    top = [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in (e.top or {}).items()][:n]
    return {"token": e.token, "logprob": max(e.logprob, FLOOR), "bytes": _bytes(e.token), "top_logprobs": top}


def _render(sandbox: TemplateSandbox, scheduler, config: ServeConfig, messages: list[dict]) -> str:
    folder = scheduler.generator.folder.path
    template = ChatTemplate.find(folder, config.chat_template)
    text = sandbox.render(template, messages, template_output_cap(scheduler.limits(), config))
    try:  # a jinja literal's escape can make a lone surrogate, which no tokenizer (and no UTF-8) takes
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "The chat template rendered invalid Unicode (a lone surrogate).", "messages",
                       "template_error") from None  # fmt: skip
    return text


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    config = request.app.state.config
    req = parse_body(await read_body(request, config.max_body_bytes, config.body_timeout_s), ChatRequest)
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {m.role!r}.",
                           f"messages.{i}.role", "invalid_value")  # fmt: skip
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true.", "top_logprobs", "invalid_value")
    scheduler = ready_scheduler(request)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    # the template is untrusted code: rendered off the event loop, in its bounded process (chat_template.py)
    # renders take turns in the one worker: the others wait here, not in (and starving) the shared thread pool
    state = request.app.state
    if getattr(state, "template_turns", None) is None:
        state.template_turns = anyio.CapacityLimiter(1)
    prompt = await anyio.to_thread.run_sync(_render, state.templates, scheduler, config, messages,
                                            limiter=state.template_turns)  # fmt: skip
    fields = req.model_dump(include=set(SamplingFields.model_fields))  # the fields a completion shares
    fields["max_tokens"] = req.max_completion_tokens or req.max_tokens
    fields["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    if fields["stream_options"] is not None:
        fields["stream_options"] = StreamOptions(**fields["stream_options"])
    as_completion = CompletionRequest.model_construct(prompt=prompt, **fields)
    return await respond(request, as_completion, ChatShape(), [prompt])
