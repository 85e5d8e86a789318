"""Generator: the user-facing runtime. Text in, text out (or streamed), on an export folder, no torch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.api_args import path_arg, text_arg
from gpt2edge.errors import GenerationError
from gpt2edge.runtime.alone import generate_alone
from gpt2edge.runtime.call_params import as_tuple, folder_defaults, merged_values, stop_strings
from gpt2edge.runtime.conversation import ContextOverflow, Conversation
from gpt2edge.runtime.decoding.beam import (
    BeamState,
    check_one_sequence,
    iter_beam_search,
)
from gpt2edge.runtime.decoding.expand import iter_generate_expanded
from gpt2edge.runtime.decoding.generate import GenerationState, Step, iter_generate, length_error
from gpt2edge.runtime.decoding.logprobs import LogprobRecorder, check_logprobs
from gpt2edge.runtime.decoding.prefix_fill import generator_prefix_cache
from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.model.contract import LM, Graph
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.memory_plan import check_generation_memory, check_session_memory
from gpt2edge.runtime.model.pool import LMPool, check_max_contexts
from gpt2edge.runtime.model.tokenizer import TextTokenizer
from gpt2edge.runtime.open_model import GraphLoading, load_graph
from gpt2edge.runtime.request import GenerationRequest, resolve, resolved
from gpt2edge.runtime.results import GenerationResult, results_of
from gpt2edge.runtime.speculative.speculator import SpecState, Speculator


class Generator:
    """Load an export folder once; generate or stream as often as you like.

    Sampling defaults follow transformers' GenerationConfig, overridden by the folder's generation_config.json,
    overridden by the arguments of each call. Passing temperature, top_k or top_p turns sampling on unless
    do_sample is given; temperature 0 means greedy.

    Concurrency: one Generator may serve generate() and stream() calls from several threads at once, and
    several streams may be interleaved in one thread; each call gives exactly the tokens it gives alone. The
    ONNX Runtime session is shared (its run is thread-safe); everything a generation mutates (KV cache, IO
    binding, bound buffers) is a per-call OrtLM from a small pool (gpt2edge.runtime.model.pool.LMPool): a call takes
    an idle one, or a new one when all are busy, and gives it back when it ends (a stream: when it is
    exhausted or closed). Sequential calls reuse `self.lm`. Concurrent calls therefore hold one KV cache each
    (max_contexts caps how many; calls beyond it wait).
    A lock around one shared context was the alternative: it cannot serve interleaved streams (they would
    deadlock or need an error), and it serialises threads that could overlap (see docs/generate.md for figures).
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        threads: int | None = None,
        verify: bool | str = True,
        io_binding: bool = True,
        draft: str | Path | None = None,
        prompt_lookup: int | None = None,
        draft_tokens: int | None = None,
        max_contexts: int | None = None,
        context_wait_s: float | None = None,
        spin: bool = True,
        deterministic: bool = False,
        prefix_cache_bytes: int = 0,
        loading: GraphLoading | None = None,
    ) -> None:
        """draft / prompt_lookup / draft_tokens: speculative decoding (gpt2edge.runtime.speculative.speculator): a draft
        model folder with the target's tokenizer, or the longest n-gram prompt lookup matches; draft_tokens
        fixes k (default: adaptive). Output as without them: the same greedy tokens, the same distribution.

        max_contexts: at most this many concurrent generate()/stream() calls hold a KV cache at once (default:
        no cap); a call beyond it waits for one to end, at most context_wait_s seconds (None: as long as it
        takes), then raises GenerationError. session() conversations hold their own context, outside the cap.
        spin=False: ONNX Runtime's idle threads sleep instead of spinning (a server's event loop needs the cores).
        deterministic: generate() runs a list of prompts one prompt at a time, each with the tokens and log-probs
        it gets alone (a batch's rows differ from them in the last bits: docs/generate.md; slower).
        prefix_cache_bytes: keep the KV of earlier prompts and generations, up to this many bytes, and reuse a
        new prompt's longest cached prefix instead of prefilling it (generate/stream of one prompt and one
        sequence, and session() turns; not with speculative decoding). 0: off. Outputs are the same.
        loading: the graph of model_dir already loading (gpt2edge.runtime.open_model.GraphLoading, started with
        this verify, device, threads and spin; the CLI starts it before importing this module), used instead of
        opening and loading the folder here."""
        check_max_contexts(max_contexts, context_wait_s)  # before the model loads
        if deterministic and prefix_cache_bytes:
            raise GenerationError(
                "deterministic=True and prefix_cache_bytes cannot be combined: a cached prefix is reused from "
                "another call's prefill, not computed as this prompt's own; pass one of them."
            )
        model_dir = path_arg(model_dir, "model_dir")
        # a draft model alternates with this graph token by token: idle threads must not spin (session.py)
        options = dict(device=device, threads=threads, spin=spin and draft is None)
        wanted = (model_dir, verify, options)
        if loading is not None and (loading.folder.path, loading.verify, loading.options) != wanted:
            raise GenerationError(
                f"loading= was started for {loading.folder.path} with verify={loading.verify!r} and "
                f"{loading.options}, not for this call's {model_dir} with verify={verify!r} and {options}."
            )
        self.folder = ModelFolder.open(model_dir, verify=verify) if loading is None else loading.folder
        try:
            self.tokenizer = TextTokenizer(self.folder.tokenizer_path, self.folder.dims.vocab_size)
        except Exception:
            if loading is not None:
                loading.wait()  # said once the session is no longer being built (the error, not the graph's)
            raise
        self.graph: Graph = load_graph(self.folder, **options) if loading is None else loading.result()
        self._pool = LMPool(self.graph, io_binding=io_binding, max_contexts=max_contexts, wait_s=context_wait_s)
        self.lm: LM = self._pool.primary  # the context sequential calls use
        self.deterministic = deterministic
        self.speculator = None
        if draft is not None or prompt_lookup is not None or draft_tokens is not None:
            self.speculator = Speculator(
                self.folder, draft, prompt_lookup, draft_tokens, device, threads, verify, io_binding
            )
        self.prefix_cache = generator_prefix_cache(self.graph, prefix_cache_bytes)
        self.defaults = folder_defaults(self.folder)
        eos = as_tuple(self.defaults.get("eos_token_id"))
        self.eos_token_id = eos
        self.bos_token_id = self.defaults.get("bos_token_id", eos[0] if eos else 0)
        pad = self.defaults.get("pad_token_id")
        self.pad_token_id = int(pad if pad is not None else (eos[0] if eos else 0))

    def _defaults(self, folder_defaults: bool) -> dict[str, Any]:
        """generation_config.json's values, or none (transformers' own defaults then apply)."""
        return self.defaults if folder_defaults else {}

    def sampling_params(
        self,
        *,
        ignore_eos: bool = False,
        stop: str | Sequence[str] | None = (),
        seed: int | None = None,
        ban: str | Sequence[str] | None = (),
        folder_defaults: bool = True,
        **overrides: Any,
    ) -> SamplingParams:
        """Merge transformers' defaults, generation_config.json and the call's non-None overrides.

        `ban` holds strings never to generate (llama.cpp's logit bias of -inf, transformers' bad_words_ids from
        text); they join any `bad_words_ids`. folder_defaults=False skips generation_config.json (an API with its
        own defaults, such as the server's OpenAI ones: some knobs, e.g. min_p, have no value that means off)."""
        values = merged_values(self._defaults(folder_defaults), overrides, self.ban_ids(ban))
        eos = () if ignore_eos else self.eos_token_id
        params = SamplingParams(**values, eos_token_id=eos, stop=stop_strings(stop), seed=seed)
        params.check_vocab(self.graph.vocab_size)  # bad-word and EOS ids the graph does not have: before any work
        return params

    def ban_ids(self, ban: str | Sequence[str] | None) -> list[tuple[int, ...]]:
        """Token-id sequences of each banned string, as it would appear mid-text (GPT-2 words carry their leading
        space, so " word" is banned too unless the string already starts with a space)."""
        out: list[tuple[int, ...]] = []
        for s in stop_strings(ban, "Banned strings"):  # a plain string is one entry, as for stop strings
            forms = [s] if s.startswith(" ") else [s, " " + s]
            out.extend(tuple(self.tokenizer.encode(f)) for f in forms)
        return list(dict.fromkeys(out))

    def encode_prompt(self, prompt: str, max_new_tokens: int, truncate: bool) -> list[int]:
        """Token ids of the prompt; raises (or, with truncate, keeps its end) when it cannot fit."""
        prompt = text_arg(prompt, "prompt")
        ids = self.tokenizer.encode(prompt) or [int(self.bos_token_id)]  # GPT-2 starts from <|endoftext|>
        error = length_error(len(ids), max_new_tokens, self.lm.n_positions)
        if error is None:
            return ids
        if truncate and max_new_tokens < self.lm.n_positions:  # truncation helps only when the prompt is the problem
            return ids[-(self.lm.n_positions - max_new_tokens) :]
        raise GenerationError(error)

    def _encode(self, prompts, truncate: bool, params: SamplingParams, rows: int = 1, logprobs=None) -> list[list[int]]:
        """Token ids of each prompt; refused when `rows` sequences per prompt would not fit in memory."""
        if not prompts:
            raise GenerationError("No prompt given.")
        ids = [self.encode_prompt(p, params.max_new_tokens, truncate) for p in prompts]
        check_generation_memory(self.folder, ids, params.max_new_tokens, rows, logprobs=logprobs)
        return ids

    def request(self, prompt: str | Sequence[str], **options: Any) -> GenerationRequest:
        """Resolve a generate() call once, before any model work: its parameters, search mode and constraint
        merged and checked, each prompt encoded and checked to fit the positions and the memory
        (gpt2edge.runtime.request.resolve: the keywords). generate() and stream() take the result as it is."""
        return resolve(self, prompt, **options)

    def generate(
        self,
        prompt: str | Sequence[str] | GenerationRequest,
        *,
        callback: Callable[[Step], None] | None = None,
        **options: Any,
    ) -> GenerationResult | list[GenerationResult] | list[list[GenerationResult]]:
        """Generate for one prompt (returns a result) or a list of prompts (a left-padded batch; a list).
        Thread-safe (see the class docstring). options: truncate, ignore_eos, stop (a string or a list), seed,
        logprobs=N (each generated token's log-prob and the N most likely alternatives: result.logprobs),
        num_beams, num_return_sequences, length_penalty, early_stopping, folder_defaults (False: transformers'
        defaults and the call's values only, not generation_config.json's), constraint (docs/structured.md:
        one matcher per row) and SamplingParams' knobs (gpt2edge.runtime.request.resolve).

        With num_return_sequences > 1 each prompt gets a list of results instead (best beam first), so a
        prompt gives a list and a list of prompts a list of lists. num_beams > 1 is beam search (results
        carry sequence_score); num_return_sequences > 1 without it samples, prefilling each prompt once.
        prompt may be a GenerationRequest (Generator.request: resolved once); it carries every option then."""
        req = resolved(self, prompt, options)
        if self.deterministic and len(req.prompts) > 1:
            return generate_alone(self, req, callback)
        prompts = [list(p) for p in req.prompts]
        if req.search.expands:
            groups = self._generate_many(callback, req)
            if req.search.num_return_sequences == 1:
                groups = [g[0] for g in groups]
            return groups[0] if req.single else groups
        recorder = self.logprob_recorder(req.logprobs, len(prompts))
        state = self._state(prompts, req.params, recorder, req.constraint)
        with self._pool.lease() as lm:
            try:
                for step in self._steps(lm, state):
                    if callback is not None:
                        callback(step)
            except KeyboardInterrupt:
                state.finish_reasons = [r or "interrupted" for r in state.finish_reasons]
        results = results_of(state)
        return results[0] if req.single else results

    def _generate_many(
        self, callback: Callable[[Step], None] | None, req: GenerationRequest
    ) -> list[list[GenerationResult]]:
        """Beam search or several samples per prompt: num_return_sequences results per prompt."""
        encoded, params, search, compiled = [list(p) for p in req.prompts], req.params, req.search, req.constraint
        with self._pool.lease() as lm:
            if search.num_beams > 1:
                state = BeamState(prompts=encoded, params=params, search=search, constraint=compiled)
                steps = iter_beam_search(lm, self.tokenizer, state, self.pad_token_id)
            else:
                state = GenerationState(prompts=encoded, params=params, constraint=compiled)
                n = search.num_return_sequences
                steps = iter_generate_expanded(lm, self.tokenizer, state, self.pad_token_id, n)
            try:
                for step in steps:
                    if callback is not None:
                        callback(step)
            except KeyboardInterrupt:
                with contextlib.suppress(StopIteration):
                    steps.throw(KeyboardInterrupt)  # the loop records what it has, then ends
        results = results_of(state)
        if isinstance(state, BeamState):
            reorder = float(np.mean(state.reorder_ms)) if state.reorder_ms else 0.0
            for r, score in zip(results, state.scores):
                r.sequence_score = score
                r.timings["reorder_ms_per_step"] = reorder
        n = search.num_return_sequences
        return [results[i : i + n] for i in range(0, len(results), n)]

    def stream(self, prompt: str | GenerationRequest, *, result: list | None = None, **options: Any) -> Iterator[str]:
        """Yield text pieces as they are decoded; never half a character, never part of a stop string. Pass
        `result=[]` to receive the GenerationResult (appended when the stream ends); its text is exactly the
        concatenated pieces. Bad parameters raise here, before the first piece. Streams of one Generator may
        be interleaved with each other and with generate() calls, in one thread or several: each holds its own
        KV cache from its first piece until it is exhausted or closed. A stream is one sequence: beam search or
        several sequences (asked for here or by generation_config.json) raise; num_beams=1 streams one anyway.
        options: generate()'s; prompt may be a GenerationRequest of one prompt and one sequence."""
        if not isinstance(prompt, GenerationRequest):
            counts = {k: options.get(k) for k in ("num_beams", "num_return_sequences")}
            check_one_sequence(self.defaults, "stream()", **counts)
            prompt, options = text_arg(prompt, "prompt"), {**options, "num_beams": 1, "num_return_sequences": 1}
        req = resolved(self, prompt, options)
        if not req.single or req.search.expands:
            raise GenerationError("stream() takes a request of one prompt and one sequence.")
        recorder = self.logprob_recorder(req.logprobs, 1)
        state = self._state([list(p) for p in req.prompts], req.params, recorder, req.constraint)
        return self._stream_pieces(state, result)

    def logprob_recorder(self, n: int | None, batch: int) -> LogprobRecorder | None:
        """None when log-probs were not asked for; raises on an N outside 0 .. vocabulary size."""
        check_logprobs(n, self.graph.vocab_size)
        return None if n is None else LogprobRecorder(self.tokenizer, int(n), batch)

    def session(self, *, on_overflow: Callable[[ContextOverflow], None] | None = None) -> Conversation:
        """A conversation that keeps its KV cache across calls: each turn prefills only its new tokens
        (gpt2edge.runtime.conversation). It has its own OrtLM on this Generator's graph."""
        check_session_memory(self.folder)  # its cache is reserved for all n_positions at once
        return Conversation(self, self.graph.new_lm(self._pool.io_binding), on_overflow=on_overflow)

    def _state(self, prompts: list[list[int]], params: SamplingParams, recorder=None, compiled=None) -> GenerationState:
        """A fresh generation's state; a speculative one checks its parameters here, before any output."""
        if self.speculator is None:
            return GenerationState(prompts=prompts, params=params, logprobs=recorder, constraint=compiled,
                                   prefix=self.prefix_cache)  # fmt: skip
        if recorder is not None:
            raise GenerationError("logprobs is not recorded by speculative decoding; drop the draft or logprobs.")
        self.speculator.check(prompts, params)
        return SpecState(prompts=prompts, params=params, constraint=compiled)

    def _steps(self, lm: LM, state: GenerationState) -> Iterator[Step]:
        """The decode loop: plain, or speculative when the Generator has a draft or prompt lookup."""
        if self.speculator is not None:
            return self.speculator.iter_generate(lm, self.tokenizer, state)
        return iter_generate(lm, self.tokenizer, state, self.pad_token_id)

    def _stream_pieces(self, state: GenerationState, result: list | None) -> Iterator[str]:
        with self._pool.lease() as lm:  # taken at the first next(), given back at the end or on close()
            for _ in self._steps(lm, state):
                piece = state.texts[0].take()  # the same matcher decided the finish reason
                if piece:
                    yield piece
        state.texts[0].finish()
        tail = state.texts[0].take()
        if tail:
            yield tail
        if result is not None:
            result.append(results_of(state)[0])
