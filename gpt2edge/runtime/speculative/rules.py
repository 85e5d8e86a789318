"""Speculative decoding's decisions: which token plain decoding would pick (greedy) or from which distribution
it would draw (sampling), and the accept/reject rule that keeps the output exactly the target's.

Every distribution here is the PROCESSED one, built by gpt2edge.runtime.decoding.sampling's own functions in the order
next_tokens applies them (repetition penalty, min_new_tokens, temperature, top-k, top-p), so a step's p is
exactly what plain sampling would draw from after the same tokens.

The rule (Leviathan et al. 2023, Chen et al. 2023): draft token x, drawn from q, is accepted with probability
min(1, p(x) / q(x)); at the first rejection the target's token is drawn from norm(max(0, p - q)); when every
draft token is accepted, one more is drawn from the target's p at the next position. Each emitted token is then
distributed exactly as under p. A deterministic drafter (prompt lookup) has a one-hot q: x is accepted with
probability p(x), and on rejection the token comes from p without x, renormalised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.decoding.sampling import SamplingParams, apply_processors, next_tokens, sample_index, warp_row

# SamplingParams fields whose effect on the next-token distribution this module reproduces (or that do not
# shape it); a field added later with a non-default value is refused rather than silently ignored
HANDLED_PARAMS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "min_p",
        "typical_p",
        "no_repeat_ngram_size",
        "bad_words_ids",
        "eos_token_id",
        "stop",
        "seed",
    }
)


@dataclass(frozen=True)
class Dist:
    """A processed next-token distribution on its support: increasing token ids and their probabilities (top-k
    and top-p keep few tokens, so nothing here touches the whole vocabulary unless the support is that big)."""

    ids: np.ndarray  # (n,) int64, increasing
    probs: np.ndarray  # (n,) float64, sums to 1

    def at(self, tokens) -> np.ndarray:
        """Probabilities of `tokens` (an id or an array of ids); 0 outside the support."""
        pos = np.minimum(np.searchsorted(self.ids, tokens), len(self.ids) - 1)
        return np.where(self.ids[pos] == tokens, self.probs[pos], 0.0)

    def sample(self, rng: np.random.Generator) -> int:
        return int(self.ids[sample_index(self.probs, rng)])


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verify step: how many draft tokens were accepted, and the target's next token."""

    accepted: int
    token: int


def check_params(params: SamplingParams) -> None:
    """Refuse what speculative decoding does not reproduce: beam search, and processors this module lacks."""
    for f in dataclasses.fields(params):
        if f.name == "num_beams" and params.num_beams > 1:  # a params kind that carries beams
            raise GenerationError(
                "Speculative decoding (--draft / --prompt-lookup) cannot be combined with beam search "
                "(num_beams > 1); drop one of them."
            )
        if f.name in HANDLED_PARAMS or f.name == "num_beams":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if getattr(params, f.name) != default:
            raise GenerationError(
                f"Speculative decoding does not support {f.name}={getattr(params, f.name)!r} yet; generate "
                "without --draft / --prompt-lookup."
            )


def processed_scores(row: np.ndarray, params: SamplingParams, seen: np.ndarray, n_generated: int) -> np.ndarray:
    """(V,) log-probs -> the (V,) scores next_tokens samples from: the processors (repetition penalty, n-gram and
    bad-word bans, min_new_tokens) over `seen` (prompt + generated), before the sampling warpers."""
    return apply_processors(row[None], params, [seen], n_generated)[0]


def target_dist(row: np.ndarray, params: SamplingParams, seen: np.ndarray, n_generated: int) -> Dist:
    """(V,) log-probs -> the distribution plain sampling draws the next token from (next_tokens' candidates)."""
    scores = processed_scores(row, params, seen, n_generated)
    ids, probs = warp_row(scores, params)  # temperature, top-k, top-p, min-p, typical-p, as plain sampling
    order = np.argsort(ids)
    probs = probs[order].astype(np.float64)
    return Dist(ids[order].astype(np.int64), probs / probs.sum())


def greedy_token(row: np.ndarray, params: SamplingParams, seen: np.ndarray, n_generated: int) -> int:
    """The token plain greedy decoding picks from these (V,) log-probs: next_tokens itself decides."""
    return int(next_tokens(row[None], params, [seen], n_generated, None)[0])


def verify_greedy(lp: np.ndarray, drafts: Sequence[int], choose: Callable[[np.ndarray, int], int]) -> Verdict:
    """lp (k+1, V): the target's log-probs after the last accepted token and after each draft token.
    choose(row, i) is the target's greedy pick at offset i. Accept drafts while they equal it."""
    for i, d in enumerate(drafts):
        t = choose(lp[i], i)
        if t != d:
            return Verdict(i, t)
    return Verdict(len(drafts), choose(lp[len(drafts)], len(drafts)))


def verify_sampled(
    lp: np.ndarray,
    drafts: Sequence[int],
    q: Sequence[Dist] | None,
    dist_at: Callable[[np.ndarray, int], Dist],
    rng: np.random.Generator,
) -> Verdict:
    """The accept/reject rule (module docstring). q: the distributions the drafts were drawn from, None for
    deterministic drafts; dist_at(row, i) is the target's processed distribution at offset i."""
    for i, x in enumerate(drafts):
        p = dist_at(lp[i], i)
        qx = 1.0 if q is None else float(q[i].at(x))
        if rng.random() * qx < p.at(x):  # accepted with probability min(1, p(x) / q(x))
            continue
        # max(0, p - q) is 0 outside p's support, so p's support is enough; q one-hot: p without x
        q_on_p = (p.ids == x).astype(np.float64) if q is None else q[i].at(p.ids)
        residual = np.maximum(p.probs - q_on_p, 0.0)
        if residual.sum() <= 0.0:  # p equals q up to rounding: the residual is empty, p is the answer
            residual = p.probs
        return Verdict(i, int(p.ids[sample_index(residual, rng)]))
    return Verdict(len(drafts), dist_at(lp[len(drafts)], len(drafts)).sample(rng))
