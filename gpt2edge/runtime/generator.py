"""Generator: the user-facing runtime. Text in, text out (or streamed), on an export folder, no torch."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.beam import BeamState, SearchParams, check_search, iter_beam_search, search_params
from gpt2edge.runtime.expand import iter_generate_expanded
from gpt2edge.runtime.generate import GenerationState, Step, iter_generate
from gpt2edge.runtime.lm import OrtLM
from gpt2edge.runtime.model_folder import ModelFolder
from gpt2edge.runtime.sampling import SamplingParams
from gpt2edge.runtime.tokenizer import StreamDecoder, TextTokenizer

# generation_config.json keys that map one-to-one onto SamplingParams
_CONFIG_KEYS = ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
_SAMPLING_KNOBS = ("temperature", "top_k", "top_p")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    timings: dict[str, float]
    sequence_score: float | None = None  # beam search: sum of log-probs / generated_len ** length_penalty

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(out.pop("timings"))  # timings flat: prefill_ms, decode_ms_per_token, ...
        return out


def _as_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


class Generator:
    """Load an export folder once; generate or stream as often as you like.

    Sampling defaults follow transformers' GenerationConfig, overridden by the folder's generation_config.json,
    overridden by the arguments of each call. Passing temperature, top_k or top_p turns sampling on unless
    do_sample is given; temperature 0 means greedy.
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        threads: int | None = None,
        verify: bool = True,
        io_binding: bool = True,
    ) -> None:
        self.folder = ModelFolder.open(model_dir, verify=verify)
        self.tokenizer = TextTokenizer(self.folder.tokenizer_path)
        self.lm = OrtLM(self.folder, device=device, threads=threads, io_binding=io_binding)
        self.defaults = self.folder.generation_defaults()
        eos = _as_tuple(self.defaults.get("eos_token_id"))
        self.eos_token_id = eos
        self.bos_token_id = self.defaults.get("bos_token_id", eos[0] if eos else 0)
        pad = self.defaults.get("pad_token_id")
        self.pad_token_id = int(pad if pad is not None else (eos[0] if eos else 0))

    def sampling_params(
        self, *, ignore_eos: bool = False, stop: Sequence[str] = (), seed: int | None = None, **overrides: Any
    ) -> SamplingParams:
        """Merge transformers' defaults, generation_config.json and the call's non-None overrides."""
        unknown = set(overrides) - set(_CONFIG_KEYS)
        if unknown:
            raise GenerationError(f"Unknown generation parameter(s): {', '.join(sorted(unknown))}.")
        values: dict[str, Any] = {k: self.defaults[k] for k in _CONFIG_KEYS if self.defaults.get(k) is not None}
        given = {k: v for k, v in overrides.items() if v is not None}
        if "do_sample" not in given and any(k in given for k in _SAMPLING_KNOBS):
            given["do_sample"] = True
        values.update(given)
        return SamplingParams(
            **values,
            eos_token_id=() if ignore_eos else self.eos_token_id,
            stop=tuple(stop),
            seed=seed,
        )

    def encode_prompt(self, prompt: str, max_new_tokens: int, truncate: bool) -> list[int]:
        ids = self.tokenizer.encode(prompt) or [int(self.bos_token_id)]  # GPT-2 starts from <|endoftext|>
        room = self.lm.n_positions - max_new_tokens
        if len(ids) > room:
            if not truncate or room < 1:
                raise GenerationError(
                    f"The prompt has {len(ids)} tokens; with max_new_tokens={max_new_tokens} only {max(room, 0)} "
                    f"fit the model's {self.lm.n_positions} positions. Shorten it, lower --max-new-tokens, "
                    "or pass --truncate to keep its end."
                )
            ids = ids[-room:]
        return ids

    def _run(
        self, prompts: Sequence[str], truncate: bool, params: SamplingParams
    ) -> tuple[GenerationState, Iterator[Step]]:
        if not prompts:
            raise GenerationError("No prompt given.")
        encoded = [self.encode_prompt(p, params.max_new_tokens, truncate) for p in prompts]
        state = GenerationState(prompts=encoded, params=params)
        return state, iter_generate(self.lm, self.tokenizer, state, self.pad_token_id)

    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        truncate: bool = False,
        callback: Callable[[Step], None] | None = None,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        seed: int | None = None,
        num_beams: int | None = None,
        num_return_sequences: int | None = None,
        length_penalty: float | None = None,
        early_stopping: bool | str | None = None,
        **sampling: Any,
    ) -> GenerationResult | list[GenerationResult] | list[list[GenerationResult]]:
        """Generate for one prompt (returns a result) or a list of prompts (a left-padded batch; a list).

        With num_return_sequences > 1 each prompt gets a list of results instead (best beam first), so a
        prompt gives a list and a list of prompts a list of lists. num_beams > 1 is beam search (results
        carry sequence_score); num_return_sequences > 1 without it samples, prefilling each prompt once.
        """
        params = self.sampling_params(ignore_eos=ignore_eos, stop=stop, seed=seed, **sampling)
        search = search_params(
            self.defaults, num_beams=num_beams, num_return_sequences=num_return_sequences,
            length_penalty=length_penalty, early_stopping=early_stopping,
        )  # fmt: skip
        check_search(search, params)
        batch = [prompt] if isinstance(prompt, str) else list(prompt)
        if search.expands:
            groups = self._generate_many(batch, truncate, callback, params, search)
            if search.num_return_sequences == 1:
                groups = [g[0] for g in groups]
            return groups[0] if isinstance(prompt, str) else groups
        state, steps = self._run(batch, truncate, params)
        try:
            for step in steps:
                if callback is not None:
                    callback(step)
        except KeyboardInterrupt:
            state.finish_reasons = [r or "interrupted" for r in state.finish_reasons]
        results = self._results(state)
        return results[0] if isinstance(prompt, str) else results

    def _generate_many(
        self,
        prompts: list[str],
        truncate: bool,
        callback: Callable[[Step], None] | None,
        params: SamplingParams,
        search: SearchParams,
    ) -> list[list[GenerationResult]]:
        """Beam search or several samples per prompt: num_return_sequences results per prompt."""
        if not prompts:
            raise GenerationError("No prompt given.")
        encoded = [self.encode_prompt(p, params.max_new_tokens, truncate) for p in prompts]
        if search.num_beams > 1:
            state = BeamState(prompts=encoded, params=params, search=search)
            steps = iter_beam_search(self.lm, self.tokenizer, state, self.pad_token_id)
        else:
            state = GenerationState(prompts=encoded, params=params)
            n = search.num_return_sequences
            steps = iter_generate_expanded(self.lm, self.tokenizer, state, self.pad_token_id, n)
        try:
            for step in steps:
                if callback is not None:
                    callback(step)
        except KeyboardInterrupt:
            with contextlib.suppress(StopIteration):
                steps.throw(KeyboardInterrupt)  # the loop records what it has, then ends
        results = self._results(state)
        if isinstance(state, BeamState):
            reorder = float(np.mean(state.reorder_ms)) if state.reorder_ms else 0.0
            for r, score in zip(results, state.scores):
                r.sequence_score = score
                r.timings["reorder_ms_per_step"] = reorder
        n = search.num_return_sequences
        return [results[i : i + n] for i in range(0, len(results), n)]

    def stream(
        self,
        prompt: str,
        *,
        truncate: bool = False,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        seed: int | None = None,
        result: list | None = None,
        **sampling: Any,
    ) -> Iterator[str]:
        """Yield text pieces as they are decoded; never half a character. Pass `result=[]` to receive the
        GenerationResult (appended when the stream ends). Bad parameters raise here, before the first piece."""
        params = self.sampling_params(ignore_eos=ignore_eos, stop=stop, seed=seed, **sampling)
        state, steps = self._run([prompt], truncate, params)
        return self._stream_pieces(state, steps, result)

    def _stream_pieces(self, state: GenerationState, steps: Iterator[Step], result: list | None) -> Iterator[str]:
        params = state.params
        decoder = StreamDecoder(self.tokenizer)
        eos = set(params.eos_token_id)
        held = ""  # text withheld because it may be the start of a stop string
        stopped = False
        for step in steps:
            if not step.active[0]:
                continue
            tok = int(step.tokens[0])
            if tok in eos:
                break
            piece = held + decoder.push(tok)
            if params.stop:
                piece, held = _split_at_stop(piece, params.stop)
                stopped = step.finished[0] == "stop"  # then piece ends right before the stop string
            if piece:
                yield piece
            if stopped:
                break
        if not stopped:
            tail = _cut_at_stop(held + decoder.flush(), params.stop)
            if tail:
                yield tail
        if result is not None:
            result.append(self._results(state)[0])

    def _results(self, state: GenerationState) -> list[GenerationResult]:
        n_decode = len(state.decode_ms)
        decode_total = sum(state.decode_ms)
        n_tokens = sum(len(g) for g in state.generated)
        timings = {
            "prefill_ms": state.prefill_ms,
            "decode_ms_per_token": decode_total / n_decode if n_decode else 0.0,
            "decode_ms_median": float(np.median(state.decode_ms)) if n_decode else 0.0,
            "sampler_ms_per_token": float(np.mean(state.sampler_ms)) if state.sampler_ms else 0.0,
            "total_ms": state.prefill_ms + decode_total + sum(state.sampler_ms),
        }
        total_s = timings["total_ms"] / 1e3
        timings["tokens_per_s"] = n_tokens / total_s if total_s > 0 else 0.0
        results = []
        for prompt, ids, reason in zip(state.prompts, state.generated, state.finish_reasons):
            text = self.tokenizer.decode(ids)
            if reason == "stop":
                text = _cut_at_stop(text, state.params.stop)
            results.append(GenerationResult(text, list(ids), list(prompt), reason or "length", dict(timings)))
        return results


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """Text before the earliest stop string (the stop string itself is not returned, like OpenAI's API)."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def _split_at_stop(piece: str, stop: Sequence[str]) -> tuple[str, str]:
    """Split streamed text into (safe to print, held back): hold a suffix that could begin a stop string."""
    cut = _cut_at_stop(piece, stop)
    if len(cut) < len(piece):
        return cut, ""
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(piece)), 0, -1):
            if piece.endswith(s[:n]):
                hold = max(hold, n)
                break
    return piece[: len(piece) - hold], piece[len(piece) - hold :]
