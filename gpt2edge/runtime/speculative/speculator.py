"""Exact speculative decoding: a drafter proposes k tokens, the target checks them all in ONE forward of k + 1
tokens (batch 1, on its KV cache), and the accept/reject rule (rules.py) keeps the output the target's:
token-identical to plain greedy decoding under greedy, the target's distribution under sampling.

One round, with history = prompt + generated tokens (the last of them not yet in the target's cache):
  1. draft k tokens after history (drafters.py)
  2. verify: feed [last token, d1 .. dk] -> log-probs after each of them, (k + 1, V) (a --head tail target
     returns just these k + 1 positions; --head all works too)
  3. accept d1 .. dn, take the target's token t after them (a correction, or a bonus when n = k)
  4. roll back the cache entries of the k - n rejected drafts (cache.py), emit d1 .. dn, t
k adapts unless fixed: +2 after a round that accepted every draft, -1 otherwise (transformers' heuristic).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.runtime.decoding.generate import GenerationState, Step, configure_head, length_error
from gpt2edge.runtime.decoding.row_decoder import RowDecoder
from gpt2edge.runtime.decoding.sampling import SamplingParams, apply_processors, greedy_tokens
from gpt2edge.runtime.model.contract import LM
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.lm import OrtGraph
from gpt2edge.runtime.model.pool import LMPool
from gpt2edge.runtime.model.tokenizer import TextStream, TextTokenizer
from gpt2edge.runtime.speculative.cache import CachedSequence
from gpt2edge.runtime.speculative.drafters import Draft, ModelDrafter, PromptLookupDrafter, check_lookup, draft_warnings
from gpt2edge.runtime.speculative.rules import check_params, greedy_token, target_dist, verify_greedy, verify_sampled

ADAPTIVE_START = 4  # first k when --draft-tokens is not given
ADAPTIVE_MAX = 16  # the adaptive k never exceeds this
DEAD_ROOM = 64  # concat caches: slots reserved for rejected drafts before one copy compacts the cache


@dataclass
class SpecStats:
    """Counters of one speculative generation (GenerationResult.timings gets them)."""

    target_steps: int = 0  # verify forwards of the target (the prefill excluded)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target accepted
    emitted: int = 0  # tokens the verify steps produced (accepted drafts + one target token each)
    draft_ms: float = 0.0  # time spent drafting (a draft model's forwards, or the n-gram search)
    compactions: int = 0  # concat-cache copies that dropped dead slots

    def timings(self) -> dict[str, float]:
        return {
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "draft_tokens": float(self.drafted),
            "accepted_tokens": float(self.accepted),
            "target_steps": float(self.target_steps),
            "tokens_per_target_step": self.emitted / self.target_steps if self.target_steps else 0.0,
            "draft_ms_total": self.draft_ms,
            "cache_compactions": float(self.compactions),
        }


@dataclass
class SpecState(GenerationState):
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass
class DraftLength:
    """k: fixed (--draft-tokens) or adaptive from ADAPTIVE_START within 1..ADAPTIVE_MAX."""

    k: int = ADAPTIVE_START
    adaptive: bool = True

    @property
    def most(self) -> int:
        return ADAPTIVE_MAX if self.adaptive else self.k

    def update(self, accepted: int, drafted: int) -> None:
        """+2 after a step that accepted every draft (transformers' heuristic); after a rejection, one more than
        were accepted: a verify position costs a third of a step on small quantized targets, and prompt lookup's
        misses come in runs (a 13-token draft rejected at its first token, then 12, 11, ... under transformers' -1)"""
        if self.adaptive and drafted:
            self.k = min(self.k + 2, ADAPTIVE_MAX) if accepted == drafted else max(1, accepted + 1)


def check_draft_tokens(k: object) -> int | None:
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise GenerationError(f"--draft-tokens must be an integer >= 1 (default: adaptive), got {k!r}.")
    return k


class Speculator:
    """Speculative decoding for a Generator on `target`: a draft model folder or prompt lookup (exactly one).

    The draft model is loaded once (its OrtGraph shared like the target's); each generation leases its own
    draft OrtLM from a pool, so concurrent generations stay independent. `warnings` holds what was warned."""

    def __init__(
        self,
        target: ModelFolder,
        draft: str | Path | None = None,
        prompt_lookup: int | None = None,
        draft_tokens: int | None = None,
        device: str = "cpu",
        threads: int | None = None,
        verify: bool | str = True,
        io_binding: bool = True,
    ) -> None:
        if (draft is None) == (prompt_lookup is None):
            raise GenerationError("Speculative decoding needs exactly one of --draft DIR and --prompt-lookup N.")
        k = check_draft_tokens(draft_tokens)
        self.lookup = None if prompt_lookup is None else check_lookup(prompt_lookup)
        self.lengths = (k, k is None)
        if target.head == "last":
            raise ModelFolderError(
                f"{target.path} returns log-probs at the last position only, and speculative decoding checks k "
                "draft tokens in one step: export the target with --head tail (or --head all)."
            )
        self.warnings: list[str] = []
        self._pool = None
        if draft is not None:
            folder = ModelFolder.open(draft, verify=verify)
            if folder.graph.static is not None:  # its fixed-capacity cache cannot take back rejected drafts
                raise ModelFolderError(
                    f"The draft {folder.path} is a static-shape export (--static), which cannot drop the draft "
                    "tokens the target rejects; export the draft without --static."
                )
            self.warnings = draft_warnings(target, folder)
            for w in self.warnings:
                warnings.warn(w, stacklevel=2)
            graph = OrtGraph(folder, device=device, threads=threads, spin=False)  # see session.create_session
            self._pool = LMPool(graph, io_binding=io_binding)

    def check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """What speculative decoding cannot run, refused before any work."""
        if len(prompts) != 1:
            raise GenerationError(
                f"Speculative decoding runs one prompt at a time, got {len(prompts)}; generate them one by one."
            )
        check_params(params)

    def iter_generate(self, lm: LM, tokenizer: TextTokenizer, state: GenerationState) -> Iterator[Step]:
        """Like generate.iter_generate, for one prompt; `state` should be a SpecState (for its stats)."""
        self.check(state.prompts, state.params)
        k, adaptive = self.lengths
        lengths = DraftLength(k or ADAPTIVE_START, adaptive)
        total = len(state.prompts[0]) + state.params.max_new_tokens
        most = min(lengths.most, state.params.max_new_tokens)  # drafts never run past max_new_tokens
        room = max(DEAD_ROOM, 2 * (most + 1))
        with self._pool.lease() if self._pool is not None else nullcontext() as draft_lm:
            if draft_lm is None:
                drafter = PromptLookupDrafter(self.lookup)
            else:
                drafter = ModelDrafter(draft_lm, total + most + 1, room)
            target = CachedSequence(lm, total + most + 1, room)
            configure_head(lm, state)  # a sparse head certifies each verify position the call allows (greedy, top-k)
            yield from speculative_steps(target, drafter, tokenizer, state, lengths)


def speculative_steps(
    target: CachedSequence, drafter, tokenizer: TextTokenizer, state: GenerationState, lengths: DraftLength
) -> Iterator[Step]:
    """The loop of the module docstring; yields one Step per emitted token (as decode_n_tokens does)."""
    params, prompt = state.params, list(state.prompts[0])
    error = length_error(len(prompt), params.max_new_tokens, target.lm.n_positions)
    if error:
        raise GenerationError(error)
    stats = state.stats if isinstance(state, SpecState) else SpecStats()
    state.texts = [TextStream(tokenizer, params.stop)]
    row = RowDecoder(params, prompt, state.texts[0], int(target.lm.graph.vocab_size))  # its text and finish rule
    state.generated, state.finish_reasons = [row.generated], [None]
    rng = np.random.default_rng(params.seed)
    history = list(prompt)
    matcher = None if state.constraint is None else state.constraint.matcher()  # the emitted tokens' grammar state
    try:
        t0 = time.perf_counter()
        lp = target.feed(history)[None]  # (1, V) after the prompt
        state.prefill_ms = (time.perf_counter() - t0) * 1e3
        draft = Draft([])
        while True:
            t1 = time.perf_counter()
            if matcher is not None:  # each position's target row among the tokens its grammar state allows
                lp = np.where(_draft_masks(matcher, draft.tokens, params.eos_token_id, lp.shape), lp, -np.inf)
            verdict = _decide(lp, draft, params, history, len(history) - len(prompt), rng)
            state.sampler_ms.append((time.perf_counter() - t1) * 1e3)
            new = draft.tokens[: verdict.accepted] + [verdict.token]
            if len(history) > len(prompt):  # a verify step, not the prefill
                target.truncate(len(history) + verdict.accepted)  # drop the rejected drafts' cache entries
                stats.accepted += verdict.accepted
                stats.emitted += len(new)
                lengths.update(verdict.accepted, len(draft.tokens))
            for tok in new:
                complete = False
                if matcher is not None and tok not in params.eos_token_id:
                    matcher.advance(tok)
                    complete = matcher.done
                step = _emit(state, row, tok, complete)
                state.wall_ms = (time.perf_counter() - t0) * 1e3
                yield step
                if state.finish_reasons[0] is not None:
                    return
            history += new
            # never draft past max_new_tokens: a round emits at most k + 1 tokens
            k = min(lengths.k, params.max_new_tokens - len(state.generated[0]) - 1)
            t2 = time.perf_counter()
            draft = drafter.propose(history, k, params, rng, len(history) - len(prompt)) if k > 0 else Draft([])
            t3 = time.perf_counter()
            lp = target.feed([history[-1], *draft.tokens], keep=len(draft.tokens) + 1)  # (k + 1, V)
            state.decode_ms.append((time.perf_counter() - t3) * 1e3)
            stats.draft_ms += (t3 - t2) * 1e3
            stats.target_steps += 1
            stats.drafted += len(draft.tokens)
            stats.compactions = target.compactions
    except KeyboardInterrupt:
        state.finish_reasons = [r or "interrupted" for r in state.finish_reasons]


def _decide(lp: np.ndarray, draft: Draft, params, history: list[int], n_generated: int, rng: np.random.Generator):
    """Run the rule on (k + 1, V) target log-probs; position i follows history + draft.tokens[:i]."""
    penalised = params.uses_history  # repetition penalty, n-gram and bad-word bans read the ids so far

    def seen(i: int) -> np.ndarray:
        return np.asarray(history + draft.tokens[:i] if penalised else (), dtype=np.int64)

    if params.greedy and params.min_new_tokens <= n_generated:
        # past min_new_tokens every row's processors depend on that row's history alone: next_tokens' own
        # processors and argmax over the (k + 1, V) block at once pick what it picks row by row
        scores = apply_processors(lp, params, [seen(i) for i in range(len(lp))], n_generated)
        picks = greedy_tokens(scores)
        _refuse_nan(lp, n_generated, picks if scores is lp else None)
        return verify_greedy(lp, draft.tokens, lambda row, i: int(picks[i]))
    _refuse_nan(lp, n_generated)
    if params.greedy:
        return verify_greedy(lp, draft.tokens, lambda row, i: greedy_token(row, params, seen(i), n_generated + i))
    dist_at = lambda row, i: target_dist(row, params, seen(i), n_generated + i)  # noqa: E731
    return verify_sampled(lp, draft.tokens, draft.q, dist_at, rng)


def _refuse_nan(lp: np.ndarray, n_generated: int, argmax: np.ndarray | None = None) -> None:
    """NaN log-probs stop the generation. `argmax`: each row's argmax over lp itself, when already taken: NumPy's
    argmax stops at a row's first NaN, so a row holds one exactly when its argmax is one (no second pass)."""
    nan = np.isnan(lp.min()) if argmax is None else np.isnan(lp[np.arange(len(lp)), argmax]).any()
    if nan:  # (min is NaN when any entry is: one pass, no (k + 1, V) bool temporary)
        raise GenerationError(
            f"The model produced NaN log-probabilities at decode step {n_generated}; generation stopped rather "
            "than emit garbage (an fp16 overflow or a corrupted model?). Try the fp32 export."
        )


def _draft_masks(matcher, drafts: list[int], eos, shape: tuple) -> np.ndarray:
    """(k + 1, V) allowed masks: row i after the emitted text and drafts[:i] (the matcher is rolled back after);
    rows past a draft token the grammar refuses are never reached (that token has probability 0): all True."""
    if shape[1] != matcher.compiled.vocab_size:
        raise GenerationError("Speculative decoding on a vocabulary-trimmed head does not take a constraint.")
    masks = np.ones(shape, dtype=bool)
    taken = 0
    for i in range(shape[0]):
        masks[i] = matcher.allowed(eos)
        if i == len(drafts) or drafts[i] in eos or not masks[i, drafts[i]]:  # (a refused token would break it)
            break
        matcher.advance(drafts[i])
        taken += 1
    if taken:
        matcher.rollback(taken)
    return masks


def _emit(state: GenerationState, row: RowDecoder, tok: int, complete: bool = False) -> Step:
    """Record one generated token; the row's finish rule (row_decoder.py) says whether it ends the row."""
    state.finish_reasons[0] = row.push(tok, complete)
    return Step(len(row.generated) - 1, np.array([tok]), np.array([True]), list(state.finish_reasons))
