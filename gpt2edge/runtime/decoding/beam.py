"""Beam search and several sequences per prompt on the ONNX runtime: parameters, the decode loop, timing.

The prompts are prefilled once and each row's cache copied to its num_beams beams (expand.py); after every
step the cache rows are reordered in place to follow the surviving beams (KVCache.reorder_rows), and the
bookkeeping (beam_search.py) is transformers' algorithm, so fp32 exports return transformers' sequences.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.constraints.rows import ConstrainedRows
from gpt2edge.runtime.decoding.beam_search import BeamSearch
from gpt2edge.runtime.decoding.expand import prefill_expanded
from gpt2edge.runtime.decoding.generate import GenerationState, Step, decode_one_token
from gpt2edge.runtime.decoding.sampling import SamplingParams, apply_processors
from gpt2edge.runtime.decoding.sampling_params import _EARLY_STOPPING, _is_int, _is_real
from gpt2edge.runtime.model.columns import Columns, lm_columns
from gpt2edge.runtime.model.contract import LM
from gpt2edge.runtime.model.tokenizer import TextStream, TextTokenizer

SEARCH_KEYS = ("num_beams", "num_return_sequences", "length_penalty", "early_stopping")


@dataclass(frozen=True)
class SearchParams:
    """transformers' GenerationConfig names and defaults. early_stopping: True stops a prompt once num_beams
    hypotheses are finished; False stops when no running beam can still beat them (judged at the current
    length); "never" only when none can at the best possible length."""

    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not _is_int(self.num_beams) or self.num_beams < 1:
            raise GenerationError(f"num_beams must be an integer >= 1 (1 = no beam search), got {self.num_beams!r}.")
        n = self.num_return_sequences
        if not _is_int(n) or n < 1:
            raise GenerationError(f"num_return_sequences must be an integer >= 1, got {n!r}.")
        if not _is_real(self.length_penalty):
            raise GenerationError(
                f"length_penalty must be a finite number (> 0 favours longer beams), got {self.length_penalty!r}."
            )
        # NumPy scalars (np.int64, np.float32) as SamplingParams takes them, held as Python numbers
        object.__setattr__(self, "num_beams", int(self.num_beams))
        object.__setattr__(self, "num_return_sequences", int(n))
        object.__setattr__(self, "length_penalty", float(self.length_penalty))
        n = self.num_return_sequences
        if self.early_stopping not in (True, False, "never"):
            raise GenerationError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}.")
        if self.num_beams > 1 and n > self.num_beams:
            raise GenerationError(
                f"num_return_sequences ({n}) must be <= num_beams ({self.num_beams}): beam search returns its best "
                "beams; raise --num-beams or lower --num-return-sequences."
            )

    @property
    def expands(self) -> bool:
        """Whether this asks for more than the plain one-sequence-per-prompt loop."""
        return self.num_beams > 1 or self.num_return_sequences > 1


def parse_early_stopping(value: Any) -> bool | str:
    """True / False / "never", also from the CLI's strings ("true", "false", "never")."""
    if isinstance(value, str):
        if value.lower() not in _EARLY_STOPPING:
            raise GenerationError(f"early_stopping must be true, false or 'never', got {value!r}.")
        return _EARLY_STOPPING[value.lower()]
    return value


def search_params(defaults: Mapping[str, Any], **overrides: Any) -> SearchParams:
    """Merge generation_config.json's values with the call's non-None overrides."""
    values = {k: defaults[k] for k in SEARCH_KEYS if defaults.get(k) is not None}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "early_stopping" in values:
        values["early_stopping"] = parse_early_stopping(values["early_stopping"])
    return SearchParams(**values)


def check_one_sequence(defaults: Mapping[str, Any], what: str, **overrides: Any) -> None:
    """stream() and sessions decode one sequence: refuse beam search or several sequences, asked for by the call
    or by generation_config.json, instead of silently returning one (transformers' generate refuses a streamer
    with beam search too). `overrides`: the call's num_beams / num_return_sequences (None: not given)."""
    search = search_params(defaults, **overrides)
    if not search.expands:
        return
    counts = {"num_beams": search.num_beams, "num_return_sequences": search.num_return_sequences}
    asked = [k for k, v in counts.items() if v > 1]
    origin = "the call" if any(overrides.get(k) is not None for k in asked) else "the folder's generation_config.json"
    raise GenerationError(
        f"{what} decodes one sequence, but {origin} asks for {' and '.join(f'{k}={counts[k]}' for k in asked)}; "
        f"pass {' and '.join(f'{k}=1' for k in asked)} to decode one, or call Generator.generate() for all of them."
    )


def check_search(search: SearchParams, params: SamplingParams) -> None:
    """Refuse the combinations that have no meaning here, before any model work."""
    if search.num_beams > 1 and params.row_penalties:  # the beams' loop does not apply RowPenalties
        raise GenerationError(
            "Beam search does not take presence_penalty, frequency_penalty, logit_bias or stop_token_ids yet; "
            "use num_beams=1."
        )
    if search.num_beams > 1 and not params.greedy:
        raise GenerationError(
            f"Beam search (num_beams={search.num_beams}) is deterministic and beam sampling is not supported; "
            "pass do_sample=False (--greedy) or use num_beams=1 to sample."
        )
    if search.num_beams == 1 and search.num_return_sequences > 1 and params.greedy:
        raise GenerationError(
            f"num_return_sequences={search.num_return_sequences} needs sampling (--do-sample; do_sample=True) "
            "or beam search (--num-beams >= it): greedy decoding returns one sequence per prompt."
        )


@dataclass
class BeamState(GenerationState):
    """A GenerationState whose rows become, at the end, the returned hypotheses (num_return_sequences per
    prompt, best first), with their scores."""

    search: SearchParams = field(default_factory=SearchParams)
    scores: list[float] = field(default_factory=list)  # sum of log-probs / generated_len ** length_penalty
    reorder_ms: list[float] = field(default_factory=list)  # one cache-row reorder per decode step


def _stop_hit(tokenizer: TextTokenizer, ids: Sequence[int], stop: Sequence[str]) -> bool:
    """Whether a stop string appears in the text of `ids`: the generate loop's own matcher (TextStream)."""
    text = TextStream(tokenizer, stop)
    return any(text.push(int(t)) for t in ids)


def _stopped(params: SamplingParams, tokenizer: TextTokenizer | None):
    """transformers' stopping criteria for candidate sequences (P, K, t) of generated tokens: EOS, a stop
    string, or max_new_tokens reached."""
    eos = np.asarray(params.eos_token_id, dtype=np.int64)

    def stopped(seqs: np.ndarray) -> np.ndarray:
        if seqs.shape[2] >= params.max_new_tokens:
            return np.ones(seqs.shape[:2], dtype=bool)
        hits = (seqs[:, :, -1, None] == eos).any(-1)
        if params.stop and tokenizer is not None:
            for p, k in zip(*np.nonzero(~hits)):
                hits[p, k] = _stop_hit(tokenizer, seqs[p, k], params.stop)
        return hits

    return stopped


def _finish_reason(ids: list[int], params: SamplingParams, text: TextStream | None) -> str:
    if ids and ids[-1] in params.eos_token_id:
        return "eos"
    if text is not None and text.stop_at is not None:
        return "stop"
    return "length"


def iter_beam_search(lm: LM, tokenizer: TextTokenizer | None, state: BeamState, pad_id: int) -> Iterator[Step]:
    """Beam search for the P prompts in state.prompts; yields after each step (tokens: the new beams' last
    token, (P*num_beams,)). At the end state.prompts / generated / finish_reasons / scores hold
    num_return_sequences hypotheses per prompt, prompt by prompt, best first."""
    params, search, prompts = state.params, state.search, state.prompts
    nb, n_ret = search.num_beams, search.num_return_sequences
    eos = params.eos_token_id
    beams = BeamSearch(
        len(prompts), nb, params.max_new_tokens, len(params.eos_token_id), search.length_penalty,
        search.early_stopping, fill=pad_id,
    )  # fmt: skip
    state.generated, state.finish_reasons = [], []
    start = time.perf_counter()
    try:
        logprobs, mask, state.prefill_ms = prefill_expanded(lm, prompts, pad_id, params.max_new_tokens, nb)
        S = lm.past_len
        positions = mask[:, :S].sum(1)  # next position of each row; the beams of a prompt share it (and its mask)
        row_prompts = [np.asarray(p, dtype=np.int64) for p in prompts for _ in range(nb)]
        stopped = _stopped(params, tokenizer)
        columns = lm_columns(lm)  # a trimmed head: its K columns, beams keep full ids
        every = np.ones(len(row_prompts), dtype=bool)
        cons = None if state.constraint is None else ConstrainedRows(state.constraint, len(every), eos, columns)
        if cons is not None and not eos:  # a complete grammar ends a beam through its end token only
            raise GenerationError("Beam search with a constraint needs the end-of-text token; drop ignore_eos.")
        for step in range(params.max_new_tokens):
            if np.isnan(logprobs).any():
                raise GenerationError(
                    f"The model produced NaN log-probabilities at decode step {step}; beam search stopped rather "
                    "than emit garbage (an fp16 overflow or a corrupted model?). Try the fp32 export."
                )
            t0 = time.perf_counter()
            scores = _process(logprobs, params, row_prompts, beams, step, columns)
            if cons is not None:  # a matcher per beam: its disallowed tokens end no candidate
                scores = np.where(cons.masks(every), scores, np.float32(-np.inf))
            rows, tokens = beams.step(scores, stopped, columns)
            if cons is not None:
                cons.follow(rows, tokens)  # each new beam: its parent's matcher, advanced by its token
            state.sampler_ms.append((time.perf_counter() - t0) * 1e3)
            state.wall_ms = (time.perf_counter() - start) * 1e3
            yield Step(step, tokens, np.ones(len(tokens), dtype=bool), [None] * len(tokens))
            if beams.done:
                break
            # the beams of a prompt share its mask rows (same prompt, same length), so only the cache moves
            t0 = time.perf_counter()
            lm.reorder_rows(rows)
            state.reorder_ms.append((time.perf_counter() - t0) * 1e3)
            mask[:, S + step] = 1
            t0 = time.perf_counter()
            logprobs = decode_one_token(lm, tokens, mask[:, : S + step + 1], positions)
            state.decode_ms.append((time.perf_counter() - t0) * 1e3)
            positions = positions + 1
    except KeyboardInterrupt:
        best = beams.interrupted(n_ret)  # the hypotheses so far, and running beams as if they ended now
        _record(state, [[(ids, s) for ids, s, _ in group] for group in best], tokenizer)
        finished = [fin for group in best for _, _, fin in group]
        state.finish_reasons = [r if fin else "interrupted" for r, fin in zip(state.finish_reasons, finished)]
        return
    _record(state, beams.best(n_ret), tokenizer)


def _process(
    logprobs: np.ndarray,
    params: SamplingParams,
    row_prompts: list[np.ndarray],
    beams: BeamSearch,
    step: int,
    columns: Columns | None = None,
) -> np.ndarray:
    """The logits processors transformers applies in beam search (no sampling warpers), in its order:
    repetition penalty, no-repeat n-gram, bad words over each beam's prompt and tokens so far, and EOS
    suppressed until min_new_tokens."""
    seen = row_prompts
    if params.uses_history:
        generated = beams.running.reshape(len(row_prompts), -1)[:, :step]  # (P*nb, step)
        seen = [np.concatenate([p, g]) for p, g in zip(row_prompts, generated)]
    return apply_processors(logprobs, params, seen, step, columns)


def _record(state: BeamState, best: list[list[tuple[list[int], float]]], tokenizer: TextTokenizer | None) -> None:
    """Turn the per-prompt hypotheses into the state's rows (prompt by prompt, best first), each with its text
    through the generate loop's matcher (cut before a stop string)."""
    prompts = state.prompts
    state.prompts, state.generated, state.finish_reasons, state.scores, state.texts = [], [], [], [], []
    for prompt, group in zip(prompts, best):
        for ids, score in group:
            text = None
            if tokenizer is not None:
                text = TextStream(tokenizer, state.params.stop)
                for t in ids:
                    text.push(int(t))
                text.finish()
                state.texts.append(text)
            state.prompts.append(list(prompt))
            state.generated.append(ids)
            state.finish_reasons.append(_finish_reason(ids, state.params, text))
            state.scores.append(score)


@dataclass
class BeamTimings:
    """Per decode step of a beam search, in ms: the model, the cache-row reorder, the beam bookkeeping."""

    num_beams: int
    rows: int
    steps: int
    decode_ms_per_step: float
    reorder_ms_per_step: float
    select_ms_per_step: float


def time_beam_search(
    lm: LM, prompts: Sequence[Sequence[int]], max_new_tokens: int, num_beams: int, pad_id: int = 0
) -> BeamTimings:
    """One beam search without EOS over tokenized prompts, timed step by step (for `bench --num-beams`)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, eos_token_id=())
    state = BeamState(prompts=[list(p) for p in prompts], params=params, search=SearchParams(num_beams=num_beams))
    for _ in iter_beam_search(lm, None, state, pad_id):
        pass

    def mean(xs: list[float]) -> float:
        return float(np.mean(xs)) if xs else 0.0

    return BeamTimings(
        num_beams, len(prompts) * num_beams, len(state.decode_ms), mean(state.decode_ms), mean(state.reorder_ms),
        mean(state.sampler_ms),
    )  # fmt: skip
