"""A Generator call resolved once: GenerationRequest, the record generate() and stream() run, and resolve(), which
builds it (every check and the prompts' encoding before any model work)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpt2edge.api_args import prompts_arg
from gpt2edge.errors import GenerationError
from gpt2edge.runtime.constraints import Constraint, compile_for
from gpt2edge.runtime.decoding.beam import SearchParams, check_search, search_params
from gpt2edge.runtime.decoding.logprobs import check_logprobs
from gpt2edge.runtime.decoding.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One generate() / stream() call resolved once: its prompts as token ids (checked to fit), its SamplingParams,
    search mode and compiled constraint. Built by resolve() (Generator.request)."""

    prompts: tuple[tuple[int, ...], ...]
    single: bool  # one prompt given as a string: generate() returns one result, not a list
    params: SamplingParams
    search: SearchParams
    constraint: Any  # a CompiledConstraint, or None
    logprobs: int | None


def resolve(
    gen: Any,  # the Generator (not imported: it imports this module)
    prompt: str | Sequence[str],
    *,
    truncate: bool = False,
    ignore_eos: bool = False,
    stop: str | Sequence[str] | None = (),
    seed: int | None = None,
    logprobs: int | None = None,
    num_beams: int | None = None,
    num_return_sequences: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    folder_defaults: bool = True,
    constraint: Constraint | None = None,
    **sampling: Any,
) -> GenerationRequest:
    """Resolve a call once: merge and check its parameters, the search mode and the constraint, encode each
    prompt (and check it fits the positions and the rows the memory), before any model work. generate() and
    stream() take the result as their prompt (the CLI checks every prompt this way before the first runs)."""
    params = gen.sampling_params(
        ignore_eos=ignore_eos, stop=stop, seed=seed, folder_defaults=folder_defaults, **sampling
    )
    search = search_params(
        gen._defaults(folder_defaults), num_beams=num_beams, num_return_sequences=num_return_sequences,
        length_penalty=length_penalty, early_stopping=early_stopping,
    )  # fmt: skip
    check_search(search, params)
    batch, single = prompts_arg(prompt)  # a str, or a list of them (TypeError otherwise)
    compiled = compile_for(gen, constraint)
    check_logprobs(logprobs, gen.graph.vocab_size)
    rows = 1
    if search.expands:
        if gen.speculator is not None:
            raise GenerationError(
                "Speculative decoding (a draft or prompt lookup) decodes one sequence per prompt; drop "
                "num_beams / num_return_sequences, or use a Generator without draft."
            )
        if logprobs is not None:
            raise GenerationError("logprobs is recorded for one sequence per prompt; drop num_beams or "
                                  "num_return_sequences, or logprobs.")  # fmt: skip
        if gen.folder.kv_cache == "static":  # fixed rows: no beam rows to expand or reorder
            raise GenerationError(
                f"{gen.folder.path} is a static-shape export (fixed batch and cache); beam search and "
                "num_return_sequences need a dynamic export (without --static)."
            )
        rows = max(search.num_beams, search.num_return_sequences)
    encoded = gen._encode(batch, truncate, params, rows, logprobs=logprobs)
    return GenerationRequest(tuple(map(tuple, encoded)), single, params, search, compiled, logprobs)


def resolved(gen: Any, prompt: Any, options: dict[str, Any]) -> GenerationRequest:
    """The call's request: `prompt` itself when it is one (then no option may be given: it would be lost)."""
    if not isinstance(prompt, GenerationRequest):
        return resolve(gen, prompt, **options)
    if options:
        raise GenerationError(f"A GenerationRequest carries its options; pass {', '.join(options)} to "
                              "Generator.request() instead.")  # fmt: skip
    return prompt
