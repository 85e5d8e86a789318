"""The speculative tests' helpers (tests/runtime/test_speculative*.py): greedy identity up to a numerical tie,
and the chi-square check that speculative sampling follows the target's distribution (and that two broken
acceptance rules fail it)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.lm import OrtLM
from gpt2edge.runtime.speculative import rules as spec_rules
from gpt2edge.runtime.speculative.speculator import SpecState

TIE = 1e-5  # top-two log-prob gap below which greedy's pick is a numerical tie
PROMPTS = ["The river rose and the river rose", "Children learned to swim", "a b a b a b", "The city"]


def _step_logprobs(folder: Path, tokens: list[int]) -> np.ndarray:
    """The target's plain next-token log-probs after `tokens` (one prefill, as plain decoding's first step)."""
    lm = OrtLM(ModelFolder.open(folder))
    lm.start(1, len(tokens))
    return lm.forward(np.asarray([tokens]), np.ones((1, len(tokens)), np.int64), np.arange(len(tokens))[None])[0]


def assert_same_greedy(folder: Path, prompt: list[int], plain: list[int], spec: list[int], tie: float = TIE) -> None:
    """Identical tokens, or a first difference where the target's top two log-probs are within `tie` (reported,
    not failed)."""
    if plain == spec:
        return
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    lp = np.sort(_step_logprobs(folder, prompt + plain[:i]))
    gap = float(lp[-1] - lp[-2])
    assert gap < tie, f"speculative greedy differs from plain greedy at token {i} (top-two gap {gap:.2e})"
    warnings.warn(f"numerical tie at token {i} (top-two gap {gap:.1e}): spec and plain greedy split", stacklevel=2)


N_SAMPLES, N_TOKENS, TOP_K = 2000, 4, 3


def _exact_distribution(folder: Path, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS tokens) under the target with top-k TOP_K at temperature 1, computed independently of
    the sampler: top-k of each step's log-probs, renormalised, multiplied along every sequence."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt = {}
        for seq, p in dist.items():
            lp = _step_logprobs(folder, prompt + list(seq))
            top = np.argsort(lp)[-TOP_K:]
            probs = np.exp(lp[top] - lp[top].max())
            for t, q in zip(top, probs / probs.sum()):
                nxt[seq + (int(t),)] = p * float(q)
        dist = nxt
    return dist


def _chi_square(samples: list[tuple[int, ...]], dist: dict[tuple[int, ...], float]) -> tuple[float, float, float]:
    """(statistic, 0.999 quantile of chi-square for its degrees of freedom, total-variation distance); cells
    expecting fewer than 5 samples are pooled into one."""
    scipy_stats = pytest.importorskip("scipy.stats")
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(dist), "a sequence the target cannot produce (outside top-k) was sampled"
    n = len(samples)
    big = [s for s, p in dist.items() if p * n >= 5]
    observed = [counts.get(s, 0) for s in big] + [n - sum(counts.get(s, 0) for s in big)]
    expected = [dist[s] * n for s in big] + [n * (1 - sum(dist[s] for s in big))]
    if expected[-1] < 5:  # the pooled rest is too small to be a cell of its own: merge it into the last one
        observed[-2:], expected[-2:] = [sum(observed[-2:])], [sum(expected[-2:])]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in dist.items())
    return stat, float(scipy_stats.chi2.ppf(0.999, len(observed) - 1)), tv


def _samples(gen: Generator, prompt: list[int], n: int = N_SAMPLES) -> tuple[list[tuple[int, ...]], SpecState]:
    """n seeded generations of N_TOKENS tokens (top-k TOP_K, temperature 1), as token tuples."""
    params = gen.sampling_params(max_new_tokens=N_TOKENS, top_k=TOP_K, do_sample=True, ignore_eos=True)
    out, total = [], SpecState(prompts=[prompt], params=params)
    for seed in range(n):
        p = dataclasses.replace(params, seed=seed)
        if gen.speculator is None:
            from gpt2edge.runtime.decoding.generate import generate

            state = generate(gen.lm, gen.tokenizer, [prompt], p, gen.pad_token_id)
        else:
            state = SpecState(prompts=[prompt], params=p)
            for _ in gen.speculator.iter_generate(gen.lm, gen.tokenizer, state):
                pass
            total.stats.drafted += state.stats.drafted
            total.stats.accepted += state.stats.accepted
        out.append(tuple(state.generated[0]))
    return out, total


def _lookup_prompt(gen: Generator) -> list[int]:
    """P + s + P, where s is the target's greedy continuation of that very prompt (a fixed point, approached in
    a few rounds): after P, prompt lookup then drafts s, the likeliest path, so drafts are often accepted."""
    from gpt2edge.runtime.decoding.generate import generate

    head = gen.tokenizer.encode("The city")
    s = head
    for _ in range(3):
        params = gen.sampling_params(max_new_tokens=N_TOKENS, do_sample=False, ignore_eos=True)
        s = generate(gen.lm, gen.tokenizer, [head + s + head], params, gen.pad_token_id).generated[0]
    return head + s + head


def check_sampling_distribution(folder, spec: Generator, label: str, monkeypatch) -> None:
    """Plain sampling on `folder` (the calibration) and speculative sampling with `spec` both pass the
    chi-square test against the exact distribution; the two broken rules fail it."""
    prompt = _lookup_prompt(Generator(folder))
    dist = _exact_distribution(folder, prompt)

    plain_samples, _ = _samples(Generator(folder), prompt)
    stat, limit, tv = _chi_square(plain_samples, dist)
    assert stat < limit, f"plain sampling: chi-square {stat:.1f} >= {limit:.1f} (TV {tv:.3f})"

    spec_samples, state = _samples(spec, prompt)
    stat, limit, tv = _chi_square(spec_samples, dist)
    print(
        f"{label}: chi-square {stat:.1f} (limit {limit:.1f}), TV {tv:.3f}, "
        f"acceptance {state.stats.accepted}/{state.stats.drafted}"
    )
    assert state.stats.drafted > N_SAMPLES // 2 and 0 < state.stats.accepted < state.stats.drafted
    assert stat < limit, f"speculative sampling: chi-square {stat:.1f} >= {limit:.1f} (TV {tv:.3f})"

    for broken in (_accept_all, _reject_from_p):
        monkeypatch.setattr("gpt2edge.runtime.speculative.speculator.verify_sampled", broken)
        samples, _ = _samples(spec, prompt, N_SAMPLES // 2)  # half as many samples: they fail by far
        caught = not set(samples) <= set(dist) or np.subtract(*_chi_square(samples, dist)[:2]) >= 0
        assert caught, f"the test cannot tell {broken.__name__} from the rule"


def _accept_all(lp, drafts, q, dist_at, rng):
    """A broken rule: every draft accepted (the output then follows the drafter)."""
    return spec_rules.Verdict(len(drafts), dist_at(lp[len(drafts)], len(drafts)).sample(rng))


def _reject_from_p(lp, drafts, q, dist_at, rng):
    """A subtler broken rule: the right acceptance test, but a rejected draft is replaced by a draw from p
    instead of norm(max(0, p - q))."""
    for i, x in enumerate(drafts):
        p = dist_at(lp[i], i)
        if rng.random() * (1.0 if q is None else float(q[i].at(x))) >= p.at(x):
            return spec_rules.Verdict(i, p.sample(rng))
    return spec_rules.Verdict(len(drafts), dist_at(lp[len(drafts)], len(drafts)).sample(rng))
