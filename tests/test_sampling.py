"""Sampling filters against transformers' logits processors (same kept set, probabilities within 1e-6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    apply_temperature,
    filter_candidates,
    next_tokens,
    softmax,
)

PROB_ATOL = 1e-6
V = 2000


def random_logits(seed: int, batch: int = 4, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((batch, V)) * scale).astype(np.float32)


def hf_probs(logits: np.ndarray, *processors, input_ids=None) -> np.ndarray:
    scores = torch.from_numpy(logits.copy())
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long) if input_ids is None else input_ids
    for p in processors:
        scores = p(ids, scores)
    return torch.softmax(scores, -1).numpy()


def our_probs(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Scatter the candidate set back into a dense (B, V) distribution."""
    ids, probs = filter_candidates(logits, top_k, top_p)
    dense = np.zeros_like(logits)
    for b in range(len(ids)):
        np.add.at(dense[b], ids[b], probs[b])  # add, not put: padding entries carry probability 0
    return dense


def assert_same_distribution(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ((ours > 0) == (ref > 0)).all(), "kept token sets differ"
    assert np.abs(ours - ref).max() < PROB_ATOL


@pytest.mark.parametrize("k", [1, 5, 50, 1999])
def test_top_k_matches_transformers(k):
    logits = random_logits(k)
    assert_same_distribution(our_probs(logits, k, 1.0), hf_probs(logits, TopKLogitsWarper(k)))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("scale", [0.3, 3.0])  # 0.3: flat distribution, top-p needs > 256 candidates
def test_top_p_matches_transformers(p, scale):
    logits = random_logits(int(p * 1000), scale=scale)
    assert_same_distribution(our_probs(logits, 0, p), hf_probs(logits, TopPLogitsWarper(p)))


def test_top_k_then_top_p_matches_transformers():
    logits = random_logits(7)
    ref = hf_probs(logits, TopKLogitsWarper(40), TopPLogitsWarper(0.8))
    assert_same_distribution(our_probs(logits, 40, 0.8), ref)


@pytest.mark.parametrize("t", [0.3, 0.7, 1.5])
def test_temperature_matches_transformers(t):
    logits = random_logits(11)
    ours = softmax(apply_temperature(logits, t))
    assert np.abs(ours - hf_probs(logits, TemperatureLogitsWarper(t))).max() < PROB_ATOL


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    logits = random_logits(13)  # positive and negative scores: divided and multiplied respectively
    seen = np.random.default_rng(0).integers(0, V, (4, 30))
    ours = apply_repetition_penalty(logits, list(seen), penalty)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(seen), torch.from_numpy(logits.copy()))
    assert np.abs(ours - ref.numpy()).max() < 1e-6
    assert np.abs(softmax(ours) - torch.softmax(ref, -1).numpy()).max() < PROB_ATOL


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 8, "do_sample": True, **kw})


def test_same_seed_same_tokens_and_different_seed_differs():
    logits = random_logits(3, scale=0.5)
    seen = [np.array([1])] * 4
    draw = lambda seed: next_tokens(logits, params(seed=seed, top_k=0), seen, 0, np.random.default_rng(seed))
    assert (draw(5) == draw(5)).all()
    assert any((draw(5) != draw(s)).any() for s in range(6, 10))


def test_top_k_one_and_temperature_zero_are_greedy():
    logits = random_logits(4)
    seen = [np.array([1])] * 4
    rng = np.random.default_rng(0)
    greedy = logits.argmax(-1)
    assert (next_tokens(logits, params(top_k=1, temperature=2.0), seen, 0, rng) == greedy).all()
    assert (next_tokens(logits, params(temperature=0.0), seen, 0, rng) == greedy).all()
    assert (next_tokens(logits, params(do_sample=False), seen, 0, rng) == greedy).all()


def test_min_new_tokens_suppresses_eos():
    logits = np.full((1, V), -10.0, np.float32)
    logits[0, 42] = 0.0  # EOS is by far the best
    p = params(do_sample=False, min_new_tokens=2, eos_token_id=(42,))
    seen = [np.array([1])]
    assert next_tokens(logits, p, seen, 0, np.random.default_rng(0))[0] != 42
    assert next_tokens(logits, p, seen, 2, np.random.default_rng(0))[0] == 42


def test_sampling_follows_filtered_distribution_chi_square():
    logits = np.log(np.array([[0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]], np.float32))
    p = params(top_k=5, top_p=0.9, temperature=0.8)
    # expected: temperature, then top-k 5, then top-p 0.9 of what is left
    ids, probs = filter_candidates(apply_temperature(logits, 0.8), 5, 0.9)
    expected = np.zeros(7)
    expected[ids[0]] = probs[0]
    rng = np.random.default_rng(123)
    n = 20000
    draws = np.array([next_tokens(logits, p, [np.array([0])], 0, rng)[0] for _ in range(n)])
    counts = np.bincount(draws, minlength=7)
    assert counts[expected == 0].sum() == 0, "sampled a filtered-out token"
    keep = expected > 0
    f_exp = expected[keep] / expected[keep].sum() * n  # float64, sums to n exactly as scipy requires
    _, pvalue = stats.chisquare(counts[keep], f_exp)
    assert pvalue > 1e-3, f"sampling does not follow the filtered distribution (p={pvalue:.2g})"


@pytest.mark.parametrize(
    "kw, phrase",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.2}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"min_new_tokens": -2}, "min_new_tokens must be >= 0"),
    ],
)
def test_invalid_parameters_are_clear_errors(kw, phrase):
    with pytest.raises(GenerationError, match=phrase.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        SamplingParams(**kw)
