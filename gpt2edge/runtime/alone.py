"""Generator(deterministic=True): a list of prompts runs one prompt at a time, so each result is bit for bit the
one that prompt gets alone (a left-padded batch is not: runtime/decoding/solo_rows.py says which kernels differ)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from gpt2edge.runtime.decoding.generate import Step
from gpt2edge.runtime.request import GenerationRequest


def generate_alone(gen: Any, req: GenerationRequest, callback: Callable[[Step], None] | None) -> list:
    """Each prompt of `req` generated alone (its own seed, its own draws); the results as the batch returns them
    (a list, or a list of lists). The callback sees a batch's shape: a step carries a slot for every prompt's rows,
    only the running prompt's rows active, so row indices keep the prompts' order."""
    out = []
    for p, prompt in enumerate(req.prompts):
        one = replace(req, prompts=(prompt,), single=True)
        hook = None if callback is None else _widened(callback, len(req.prompts), p)
        out.append(gen.generate(one, callback=hook))
    return out


def _widened(callback: Callable[[Step], None], prompts: int, p: int) -> Callable[[Step], None]:
    """Prompt p's steps (k rows each) as steps of prompts x k rows, the others inactive."""

    def hook(step: Step) -> None:
        k = len(step.tokens)
        B, first = prompts * k, p * k
        tokens = np.zeros(B, dtype=step.tokens.dtype)
        tokens[first : first + k] = step.tokens
        active = np.zeros(B, dtype=bool)
        active[first : first + k] = step.active
        finished: list[str | None] = [None] * B
        finished[first : first + k] = step.finished
        logprobs = None
        if step.logprobs is not None:
            logprobs = [None] * B
            logprobs[first : first + k] = step.logprobs
        callback(Step(step.index, tokens, active, finished, logprobs))

    return hook
