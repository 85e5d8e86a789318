"""A request's sampling fields -> a checked Sampling: OpenAI's, and vLLM's / llama-server's extras.

Off values as each server spells them: top_k 0 or -1, min_p 0, typical_p 1, repetition_penalty 1, penalties 0.
logit_bias keys are token ids (as strings, OpenAI's form), values in [-100, 100]; ids past the vocabulary, and
stop_token_ids past it, are a 400 naming the id.
"""

from __future__ import annotations

from typing import Any

from gpt2edge.serve.api.protocol import ApiError
from gpt2edge.serve.scheduling.jobs import Sampling

ROW_EXTRAS = ("presence_penalty", "frequency_penalty", "logit_bias", "stop_token_ids")


def _token_id(key: str, vocab_size: int, field: str) -> int:
    if not key.lstrip("-").isdigit() or len(key) > 12:
        raise ApiError(400, f"{field} keys must be token ids (e.g. \"50256\"), got {key!r}.", field, "invalid_value")
    tid = int(key)
    if not 0 <= tid < vocab_size:
        raise ApiError(400, f"{field}: token id {tid} is outside the vocabulary (0..{vocab_size - 1}).", field,
                       "invalid_value")  # fmt: skip
    return tid


def sampling_from(req: Any, vocab_size: int, row_extras: bool) -> Sampling:
    """row_extras: the scheduler applies penalties, logit_bias and stop_token_ids (the continuous one does)."""
    given = [name for name in ROW_EXTRAS if getattr(req, name, None)]
    if given and not row_extras:
        raise ApiError(400, f"{given[0]} needs the continuous scheduler; this server runs next-batch (or a --static "
                       "folder); omit it.", given[0], "unsupported")  # fmt: skip
    bias = tuple((_token_id(k, vocab_size, "logit_bias"), float(v)) for k, v in (req.logit_bias or {}).items())
    stop_ids = tuple(_token_id(str(t), vocab_size, "stop_token_ids") for t in (req.stop_token_ids or ()))
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return Sampling(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        top_k=top_k,
        min_p=req.min_p if req.min_p else None,
        typical_p=1.0 if req.typical_p is None else req.typical_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens or 0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias,
        stop_token_ids=stop_ids,
    )
