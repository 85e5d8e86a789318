"""The OpenAI wire format: the request schema, OpenAI-shaped errors, and response bodies."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpt2edge.serve.config import MAX_STOP


class ApiError(Exception):
    """An error the client sees as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. Unknown fields are refused; fields OpenAI has that this server cannot honour are
    accepted only at their neutral value (plan.py says which). ignore_eos is an extension."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str | list[str]
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (plan.py)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)  # at most MAX_LOGPROBS (plan.py)
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None
    ignore_eos: bool = False


_HINTS = {
    "prompt": "prompt must be a string or a list of strings (token-id prompts are not supported).",
    "stop": f"stop must be a string or a list of up to {MAX_STOP} strings.",
}


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_request(body: bytes) -> CompletionRequest:
    """Bytes -> CompletionRequest, or an ApiError(400) that names the problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        message = f"The request body is not valid UTF-8 (byte {e.start}); send UTF-8 JSON."
        raise ApiError(400, message, code="invalid_encoding") from None
    try:
        obj = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ApiError(400, f"The request body is not valid JSON ({e}).", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    _refuse_lone_surrogates(obj)
    try:
        return CompletionRequest.model_validate(obj)
    except ValidationError as e:
        raise _as_api_error(e) from None


def _refuse_lone_surrogates(obj: dict[str, Any]) -> None:
    """A JSON escape such as "\\ud800" decodes to a str that is not Unicode text: no tokenizer takes it."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        message = "The request holds a lone UTF-16 surrogate escape (e.g. \\ud800); send valid Unicode text."
        raise ApiError(400, message, code="invalid_encoding") from None


def _as_api_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "extra_forbidden":
        known = ", ".join(CompletionRequest.model_fields)
        return ApiError(400, f"Unknown field '{field}'; this server accepts: {known}.", field, "unknown_field")
    if err["type"] == "missing":
        return ApiError(400, f"{field} is required.", field, "missing_field")
    if field in _HINTS:
        return ApiError(400, _HINTS[field], field, "invalid_type")
    got = repr(err.get("input"))
    got = got if len(got) <= 40 else got[:37] + "..."
    return ApiError(400, f"{field}: {err['msg']} (got {got}).", field, "invalid_value")


def completion_body(
    cid: str,
    created: int,
    model: str,
    texts: list[str],
    reasons: list[str],
    usage: dict[str, int],
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """logprobs: each choice's `logprobs` object, when the request asked for them."""
    blocks = logprobs if logprobs is not None else [None] * len(texts)
    choices = [
        {"text": t, "index": i, "logprobs": lp, "finish_reason": r}
        for i, (t, r, lp) in enumerate(zip(texts, reasons, blocks))
    ]
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chunk_body(
    cid: str, created: int, model: str, choice: int, text: str, reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    """One streamed event: new text of one choice (finish_reason on its last one) and, when asked for, the
    log-probs of the tokens that start in that text."""
    body = completion_body(cid, created, model, [], [], {})
    body["choices"] = [{"text": text, "index": choice, "logprobs": logprobs, "finish_reason": reason}]
    del body["usage"]
    return body


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n".encode()
