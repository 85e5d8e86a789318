"""The OpenAI wire format: the request schema, OpenAI-shaped errors, and response bodies."""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpt2edge.serve.config import MAX_STOP

M = TypeVar("M", bound="BaseModel")


class ApiError(Exception):
    """An error the client sees as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers  # e.g. Retry-After on a 429 or 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


Bias = Annotated[float, Field(ge=-100, le=100)]  # a logit_bias value (OpenAI's range)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share: OpenAI's sampling knobs and vLLM's and
    llama-server's extras (sampling_fields.py: their off values). Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Bias] | None = Field(None, max_length=1024)
    user: str | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    typical_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    # structured output, at most one (serve/api/constraint_fields.py): OpenAI's, llama-server's, vLLM's
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. Fields OpenAI has that this server cannot honour are accepted only at their neutral
    value (plan.py says which). ignore_eos is an extension."""

    prompt: str | list[str]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (plan.py)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)  # at most MAX_LOGPROBS (plan.py)
    best_of: int | None = None
    suffix: str | None = None


_HINTS = {
    "prompt": "prompt must be a string or a list of strings (token-id prompts are not supported).",
    "stop": f"stop must be a string or a list of up to {MAX_STOP} strings.",
}


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


class DuplicateKey(ValueError):
    """A JSON object names one key twice: which value was meant is unknowable (json.loads keeps the last)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def parse_request(body: bytes) -> CompletionRequest:
    """Bytes -> CompletionRequest, or an ApiError(400) that names the problem."""
    return parse_body(body, CompletionRequest)


def parse_body(body: bytes, model: type[M]) -> M:
    """Bytes -> a request model: UTF-8 JSON, one object, no key twice, no lone surrogate, valid fields."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        message = f"The request body is not valid UTF-8 (byte {e.start}); send UTF-8 JSON."
        raise ApiError(400, message, code="invalid_encoding") from None
    try:
        obj = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except DuplicateKey as e:
        message = f"The request body gives the key '{e}' more than once; send each field once."
        raise ApiError(400, message, str(e), "duplicate_key") from None
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ApiError(400, f"The request body is not valid JSON ({e}).", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    _refuse_lone_surrogates(obj)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _as_api_error(e, model) from None


def _refuse_lone_surrogates(obj: dict[str, Any]) -> None:
    """A JSON escape such as "\\ud800" decodes to a str that is not Unicode text: no tokenizer takes it."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        message = "The request holds a lone UTF-16 surrogate escape (e.g. \\ud800); send valid Unicode text."
        raise ApiError(400, message, code="invalid_encoding") from None


def _as_api_error(e: ValidationError, root: type[BaseModel]) -> ApiError:
    err = e.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "extra_forbidden":
        # the unknown field may be nested (stream_options.x): name it by its path, and list its object's fields
        path = ".".join(str(p) for p in err["loc"])
        model = _nested_model(root, err["loc"][:-1])
        where = "this server" if len(err["loc"]) == 1 else f"{'.'.join(map(str, err['loc'][:-1]))}"
        known = ", ".join(model.model_fields) if model is not None else ""
        return ApiError(400, f"Unknown field '{path}'; {where} accepts: {known}.", path, "unknown_field")
    if err["type"] == "missing":
        return ApiError(400, f"{field} is required.", field, "missing_field")
    hints = {**_HINTS, **getattr(root, "hints", {})}  # a model may spell a field's expected type its own way
    if field in hints:
        return ApiError(400, hints[field], field, "invalid_type")
    got = repr(err.get("input"))
    got = got if len(got) <= 40 else got[:37] + "..."
    return ApiError(400, f"{field}: {err['msg']} (got {got}).", field, "invalid_value")


def _nested_model(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model at a location path (None where it is not a model: a list item, a dict)."""
    import typing

    for part in loc:
        if isinstance(part, int):  # a list index: the item is the list's own model
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        candidates = [a for a in (field.annotation, *typing.get_args(field.annotation)) if isinstance(a, type)]
        nested = [a for a in candidates if issubclass(a, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


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


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: the prompt tokens the prefix cache supplied (not prefilled)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n".encode()
