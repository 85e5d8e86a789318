"""A parsed request checked against this model and server: what to decode, or a 4xx that says how to fix it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpt2edge.serve.api.constraint_fields import constraint_from
from gpt2edge.serve.api.protocol import ApiError, CompletionRequest
from gpt2edge.serve.api.sampling_fields import sampling_from
from gpt2edge.serve.config import MAX_LOGPROBS, MAX_STOP, ServeConfig
from gpt2edge.serve.scheduling.jobs import Sampling
from gpt2edge.serve.scheduling.model_limits import ModelLimits

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Plan:
    prompts: list[str]
    prompt_lens: list[int]
    prompt_ids: list[list[int]]
    n: int
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # report each generated token's log-prob and its top N (0: the token's only)
    constraint: Any = None  # structured output: the request's constraint compiled for this model (or None)


def _refuse_unsupported(req: CompletionRequest, n: int) -> None:
    """OpenAI fields this server cannot honour are accepted only at their neutral value."""
    if req.suffix:
        raise ApiError(400, "suffix (insertion) is not supported by GPT-2; omit it.", "suffix", "unsupported")
    if req.best_of not in (None, n):
        raise ApiError(400, f"best_of is not supported; omit it or set it equal to n ({n}).", "best_of", "unsupported")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true.", "stream_options", "invalid_value")


def _check_logprobs(req: CompletionRequest, cap: int) -> None:
    """0 .. cap, and not with echo: the runtime scores generated tokens, not the prompt's."""
    if req.logprobs is None:
        return
    if req.logprobs > cap:
        raise ApiError(
            400,
            f"logprobs must be at most {cap} on this server (OpenAI's limit), got {req.logprobs}.",
            "logprobs",
            "invalid_value",
        )
    if req.echo:
        raise ApiError(
            400,
            "echo with logprobs is not supported: this server reports log-probs of generated tokens only (prompt "
            "tokens are not scored); drop echo, or logprobs.",
            "logprobs",
            "unsupported",
        )


def _max_tokens(req: CompletionRequest, n_positions: int) -> int:
    """OpenAI's default 16; 0 only with echo (the prompt comes back, nothing is decoded)."""
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise ApiError(
            400,
            "max_tokens 0 asks for no completion, and without echo there is nothing to return; send max_tokens "
            ">= 1, or echo: true to get the prompt back.",
            "max_tokens",
            "invalid_value",
        )
    if max_tokens >= n_positions:
        raise ApiError(
            400,
            f"max_tokens must be less than the model's {n_positions} positions (the prompt needs at least one), "
            f"got {max_tokens}.",
            "max_tokens",
            "invalid_value",
        )
    return max_tokens


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP:
        raise ApiError(400, f"stop takes at most {MAX_STOP} strings, got {len(strings)}.", "stop", "invalid_value")
    if any(not s for s in strings):
        raise ApiError(400, "stop strings must not be empty.", "stop", "invalid_value")
    return tuple(strings)


def prompt_byte_cap(limits: ModelLimits) -> int | None:
    """The most UTF-8 bytes of a prompt that can fit the context: every token covers at most max_token_bytes."""
    return None if limits.max_token_bytes is None else limits.n_positions * limits.max_token_bytes


def template_output_cap(limits: ModelLimits, config: ServeConfig) -> int:
    """What a chat template may render: no more than fits the context, else a few times the body limit."""
    cap = prompt_byte_cap(limits)
    return cap if cap is not None else 4 * config.max_body_bytes + (64 << 10)


def _refuse_by_bytes(prompts: list[str], max_tokens: int, limits: ModelLimits) -> None:
    """A prompt of B bytes has at least ceil(B / max_token_bytes) tokens: one far over the context is refused
    from its length, before the tokenizer spends a second on a megabyte."""
    if limits.max_token_bytes is None:
        return
    for i, prompt in enumerate(prompts):
        size = len(prompt.encode("utf-8", "surrogatepass"))  # a lone surrogate is refused when it is tokenized
        at_least = -(-size // limits.max_token_bytes)
        if at_least + max_tokens > limits.n_positions:
            which = "The prompt" if len(prompts) == 1 else f"Prompt {i}"
            raise ApiError(400, f"This model's maximum context length is {limits.n_positions} tokens. {which} has "
                           f"{size} bytes, so at least {at_least} tokens (a token covers at most "
                           f"{limits.max_token_bytes} bytes), and max_tokens is {max_tokens}; shorten the prompt.",
                           "prompt", "context_length_exceeded")  # fmt: skip


def plan_request(
    req: CompletionRequest,
    config: ServeConfig,
    limits: ModelLimits,
    prompts: list[str] | None = None,
    max_logprobs: int = MAX_LOGPROBS,
) -> Plan:
    """Check the request against the model and the server's limits; encode the prompts (`prompts`: the ones a
    chat template rendered, instead of req.prompt; max_logprobs: the endpoint's cap on alternatives)."""
    max_rows, n_positions = limits.max_rows, limits.n_positions
    if req.model is not None and req.model != config.model_name:
        raise ApiError(
            404,
            f"The model '{req.model}' does not exist here; this server serves '{config.model_name}' (GET /v1/models).",
            "model",
            "model_not_found",
        )
    n = 1 if req.n is None else req.n
    _refuse_unsupported(req, n)
    if n > config.max_n:
        raise ApiError(400, f"n must be at most {config.max_n} on this server, got {n}.", "n", "invalid_value")
    if prompts is None:
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    if not prompts:
        raise ApiError(400, "prompt must not be an empty list.", "prompt", "invalid_value")
    if len(prompts) * n > max_rows:
        why = limits.rows_why
        raise ApiError(
            400,
            f"This request asks for {len(prompts) * n} completions ({len(prompts)} prompt(s) x n={n}); this server "
            f"decodes at most {max_rows} per request{why}. Split it into several requests.",
            "n",
            "invalid_value",
        )
    _check_logprobs(req, max_logprobs)
    stop = _stop_strings(req.stop)
    max_tokens = _max_tokens(req, n_positions)
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens",
                       "invalid_value")  # fmt: skip
    sampling = sampling_from(req, limits.vocab_size)
    constraint, compiled = constraint_from(req, limits.compile)
    if constraint is not None:
        sampling = replace(sampling, constraint=constraint)
    _refuse_by_bytes(prompts, max_tokens, limits)
    ids = [list(limits.encode(p)) for p in prompts]
    lens = [len(i) for i in ids]
    for i, plen in enumerate(lens):
        if plen + max_tokens > n_positions:
            which = "The prompt" if len(prompts) == 1 else f"Prompt {i}"
            raise ApiError(
                400,
                f"This model's maximum context length is {n_positions} tokens. {which} has {plen} tokens and "
                f"max_tokens is {max_tokens}; shorten the prompt or lower max_tokens.",
                "prompt",
                "context_length_exceeded",
            )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Plan(prompts, lens, ids, n, max_tokens, sampling, stop, req.stream, include_usage, req.echo, req.logprobs,
                compiled)  # fmt: skip
