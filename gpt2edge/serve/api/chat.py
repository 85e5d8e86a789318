"""POST /v1/chat/completions for folders whose tokenizer carries a chat template (e.g. DialoGPT-style).

The template is rendered as transformers' apply_chat_template renders it: jinja2's ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` filter and `raise_exception`, given
`messages`, `add_generation_prompt=True` and the tokenizer's special tokens. The template comes from, in order:
the server's --chat-template file, the folder's chat_template.jinja, its tokenizer_config.json "chat_template".
A folder with none gets a 400 that says so. The rendered prompt is then an ordinary completion request.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from gpt2edge.serve.api.completions import Meta, respond
from gpt2edge.serve.api.http import read_body
from gpt2edge.serve.api.protocol import ApiError, CompletionRequest, SamplingFields, StreamOptions, parse_body
from gpt2edge.serve.hosting.config import MAX_TOP_LOGPROBS
from gpt2edge.serve.scheduling.logprobs import FLOOR, TokenEntry
from gpt2edge.serve.scheduling.plan import Plan

router = APIRouter()
NO_TEMPLATE = (
    "This model's folder has no chat template (chat_template.jinja or tokenizer_config.json's chat_template), so "
    "/v1/chat/completions cannot render messages; use /v1/completions with a prompt, or start the server with "
    "--chat-template FILE."
)
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
    scheduler = request.app.state.scheduler
    folder = None if scheduler is None else scheduler.generator.folder.path
    prompt = render(ChatTemplate.find(folder, config.chat_template), [m.model_dump(exclude_none=True)
                                                                       for m in req.messages])  # fmt: skip
    fields = req.model_dump(include=set(SamplingFields.model_fields))  # the fields a completion shares
    fields["max_tokens"] = req.max_completion_tokens or req.max_tokens
    fields["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    if fields["stream_options"] is not None:
        fields["stream_options"] = StreamOptions(**fields["stream_options"])
    as_completion = CompletionRequest.model_construct(prompt=prompt, **fields)
    return await respond(request, as_completion, ChatShape(), [prompt])


class ChatTemplate:
    """A template source and the special tokens it may name."""

    def __init__(self, source: str, tokens: dict[str, str]) -> None:
        self.source, self.tokens = source, tokens

    @staticmethod
    def find(folder: Path | None, override: str | None) -> ChatTemplate:
        return _find(None if folder is None else str(folder), override)


@lru_cache(maxsize=8)
def _find(folder: str | None, override: str | None) -> ChatTemplate:
    tokens: dict[str, str] = {}
    config: dict[str, Any] = {}
    if folder is not None and (Path(folder) / "tokenizer_config.json").is_file():
        try:
            config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                tokens[key] = value
    tokens.setdefault("eos_token", "<|endoftext|>")
    tokens.setdefault("bos_token", tokens["eos_token"])
    if override is not None:
        return ChatTemplate(Path(override).read_text(), tokens)
    if folder is not None and (Path(folder) / "chat_template.jinja").is_file():
        return ChatTemplate((Path(folder) / "chat_template.jinja").read_text(), tokens)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers uses "default"
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise ApiError(400, NO_TEMPLATE, "messages", "no_chat_template")
    return ChatTemplate(source, tokens)


def render(template: ChatTemplate, messages: list[dict]) -> str:
    """transformers' rendering of a chat template (its _compile_jinja_template's environment)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template.source).render(messages=messages, add_generation_prompt=True,
                                                       **template.tokens)  # fmt: skip
    except jinja2.exceptions.TemplateError as e:
        raise ApiError(400, f"The chat template refused these messages: {e}", "messages", "template_error") from None

