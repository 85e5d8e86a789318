"""A request's sampling fields -> a checked Sampling: OpenAI's, and vLLM's / llama-server's extras.

Off values as each server spells them: top_k 0 or -1, min_p 0, typical_p 1, repetition_penalty 1, penalties 0.
logit_bias keys are token ids (as strings, OpenAI's form), values in [-100, 100]; ids past the vocabulary, and
stop_token_ids past it, are a 400 naming the id.
"""

from __future__ import annotations

from typing import Any

from gpt2edge.serve.api.protocol import ApiError
from gpt2edge.serve.scheduling.jobs import Sampling


def _bias_id(key: str, vocab_size: int) -> int:
    """A logit_bias key: a token id in ASCII decimal digits, no sign, space or leading zero ("05" would be a second
    name for 5; str.isdigit takes "٥" and "５" as well, and int() reads them)."""
    if not (key.isascii() and key.isdigit() and len(key) <= 12 and (key == "0" or not key.startswith("0"))):
        raise ApiError(400, f"logit_bias keys must be token ids in ASCII digits without sign or leading zero (e.g. "
                       f"\"50256\"), got {key!r}.", "logit_bias", "invalid_value")  # fmt: skip
    return _in_vocab(int(key), vocab_size, "logit_bias")


def _in_vocab(tid: int, vocab_size: int, field: str) -> int:
    if not 0 <= tid < vocab_size:
        shown = str(tid) if len(str(tid)) <= 24 else f"{str(tid)[:20]}..."
        raise ApiError(400, f"{field}: token id {shown} is outside the vocabulary (0..{vocab_size - 1}).", field,
                       "invalid_value")  # fmt: skip
    return tid


def sampling_from(req: Any, vocab_size: int) -> Sampling:
    """The request's sampling fields, checked (either scheduler applies every one: the runtime's RowDecoder)."""
    bias = tuple((_bias_id(k, vocab_size), float(v)) for k, v in (req.logit_bias or {}).items())
    stop_ids = tuple(_in_vocab(t, vocab_size, "stop_token_ids") for t in (req.stop_token_ids or ()))
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
