"""Each processor against the installed transformers processor of the same name: transformers' own unit-test
vectors (tests/generation/test_logits_process.py) and random inputs up to GPT-2's 50,257-token vocabulary.
Agreement means: the same kept token set, probabilities after softmax within 1e-6."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from gpt2edge.runtime.decoding.sampling import (
    SamplingParams,
    apply_bad_words,
    apply_min_new_tokens,
    apply_no_repeat_ngram,
    apply_repetition_penalty,
    softmax,
    warp_row,
)

PROB_ATOL = 1e-6
VOCABS = (10, 1000, 50257)
KINDS = ("flat", "peaked", "very_peaked", "ties", "uniform")


def log_probs(kind: str, vocab: int, seed: int, batch: int = 3) -> np.ndarray:
    """(batch, vocab) float32 log-probabilities, like the graph's output."""
    x = np.random.default_rng(seed).standard_normal((batch, vocab))
    x = {"flat": 0.5 * x, "peaked": 3 * x, "very_peaked": 8 * x, "ties": np.round(3 * x), "uniform": 0 * x}[kind]
    x -= np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x.max(-1, keepdims=True)
    return x.astype(np.float32)


def hf_probs(scores: np.ndarray, *processors, input_ids: torch.Tensor | None = None) -> np.ndarray:
    t = torch.from_numpy(scores.copy())
    for p in processors:
        t = p(input_ids, t)
    return torch.softmax(t, -1).numpy()


def our_probs(scores: np.ndarray, **options) -> np.ndarray:
    """warp_row on every row (sampling on, top-k off unless given), scattered back to (B, V)."""
    params = SamplingParams(do_sample=True, **{"top_k": 0, **options})
    dense = np.zeros_like(scores)
    for b, row in enumerate(scores):
        ids, probs = warp_row(row, params)
        dense[b, ids] = probs
    return dense


def exact_softmax(scores: np.ndarray) -> np.ndarray:
    x = scores.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def assert_same(ours: np.ndarray, ref: np.ndarray, scores: np.ndarray, sensitive: np.ndarray | None = None) -> None:
    """Same kept token set, probabilities within 1e-6 of transformers'.

    `sensitive` marks tokens whose transformers decision sits within its own float32 rounding of the threshold
    (top_p_allowance, typical_p_sensitive, min_p_sensitive); only there may the kept sets differ. torch sums a
    softmax in float32 lanes, which over tens of thousands of kept tokens is itself off by more than 1e-6 (ours
    is within ~1e-8 of exact), so probabilities are held to 1e-6 beyond transformers' own error.
    """
    differ = (ours > 0) != (ref > 0)
    allowed = np.zeros_like(differ) if sensitive is None else sensitive
    assert not (differ & ~allowed).any(), f"kept sets differ at {np.argwhere(differ & ~allowed)[:5].tolist()}"
    for o, r, s, d in zip(ours, ref, scores, differ):
        kept = r > 0
        exact = exact_softmax(np.where(o > 0, s, -np.inf))  # over our kept set
        assert np.abs(o - exact).max() < 1e-7
        if not d.any():
            torch_error = np.abs(r - exact)
            assert (np.abs(o - r)[kept] < PROB_ATOL + torch_error[kept]).all()


def _cumulative(p: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Per token: the exact mass of it and every token before it in `order`."""
    c = np.empty_like(p)
    c[order] = np.cumsum(p[order])
    return c


def top_p_allowance(scores: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(near, split) token masks for TopPLogitsWarper's decision.

    near: the exact ascending cumulative mass is within 1e-5 of 1 - top_p; torch's float32 softmax is off by a
    few 1e-6, so its decision there is rounding. split: a tie group the cut splits; torch.sort orders ties
    arbitrarily, so which of them survive is arbitrary (how many is not).
    """
    near, split = np.zeros(scores.shape, bool), np.zeros(scores.shape, bool)
    for b, row in enumerate(scores):
        c = _cumulative(exact_softmax(row), np.argsort(row, kind="stable"))
        near[b] = np.abs(c - (1 - top_p)) < 1e-5
        _, group = np.unique(row, return_inverse=True)
        n_removed = np.bincount(group, weights=c <= 1 - top_p)
        split[b] = ((n_removed > 0) & (n_removed < np.bincount(group)))[group]
    return near, split


def assert_same_top_p(ours: np.ndarray, ref: np.ndarray, scores: np.ndarray, top_p: float) -> None:
    near, split = top_p_allowance(scores, top_p)
    assert_same(ours, ref, scores, near | split)
    exact_rows = ~near.any(-1)  # away from rounding, a split tie group keeps as many tokens as transformers keeps
    assert ((ours > 0).sum(-1) == (ref > 0).sum(-1))[exact_rows].all()


def typical_p_sensitive(scores: np.ndarray, mass: float) -> np.ndarray:
    """Tokens the cut of TypicalLogitsWarper can move over within torch's float32 rounding: those ranked where
    the exact cumulative mass is within 1e-5 of `mass` (and the next rank), and those whose |-log p - entropy|
    is within 1e-4 of the cut's (torch's float32 entropy is off by up to ~1e-5)."""
    out = np.zeros(scores.shape, bool)
    for b, row in enumerate(scores):
        p = exact_softmax(row)
        logp = np.log(p)
        shifted = np.abs(-logp - (-(logp * p).sum()))
        order = np.argsort(shifted, kind="stable")
        c = np.cumsum(p[order])
        cut = shifted[order[min(int((c < mass).sum()), row.size - 1)]]
        near = np.flatnonzero(np.abs(c - mass) < 1e-5)
        out[b, order[np.minimum(np.concatenate([near, near + 1]), row.size - 1)]] = True
        out[b] |= np.abs(shifted - cut) < 1e-4
    return out


def min_p_sensitive(scores: np.ndarray, min_p: float) -> np.ndarray:
    """Tokens whose probability is within 1e-5 (relative) of min_p x the best one's."""
    p = exact_softmax(scores)
    return np.abs(p / p.max(-1, keepdims=True) - min_p) < 1e-5 * min_p


# ---- transformers' unit-test vectors -------------------------------------------------------------------------


def test_top_p_unit_vector_keeps_two_tokens_at_an_exact_sum():
    dist = np.log(np.array([[0.3, 0.1, 0.1, 0.5], [0.15, 0.3, 0.3, 0.25]], np.float32))
    kept = our_probs(dist, top_p=0.8) > 0
    assert kept.tolist() == [[True, False, False, True], [False, True, True, True]]
    assert_same(our_probs(dist, top_p=0.8), hf_probs(dist, TopPLogitsWarper(0.8)), dist)  # no rounding allowance


def test_top_p_unit_vector_ramp():
    ramp = np.tile(np.arange(10, dtype=np.float32) - 5, (2, 1))
    ramp[1] *= 100
    assert ((our_probs(ramp, top_p=0.9) > 0).sum(-1)).tolist() == [3, 1]


def test_top_k_unit_vectors_keep_ties():
    ramp = np.tile(np.arange(10, dtype=np.float32), (2, 1))
    ramp[1, :5] += 10
    kept = our_probs(ramp, top_k=3) > 0
    assert kept.tolist() == [7 * [False] + 3 * [True], 2 * [False] + 3 * [True] + 5 * [False]]
    uniform = np.full((2, 5), 1 / 5, np.float32)
    assert (our_probs(uniform, top_k=1) > 0).all()  # a uniform row is not changed: all tie with the best


def test_temperature_unit_vector():
    scores = np.full((2, 20), 1 / 20, np.float32)
    scores[1, 5] = 1 / 20 + 0.1
    scores[1, 10] = 1 / 20 - 0.4
    base, sharp, smooth = softmax(scores[1]), our_probs(scores, temperature=0.5), our_probs(scores, temperature=1.3)
    assert np.allclose(sharp[0], 1 / 20) and np.allclose(smooth[0], 1 / 20)  # uniform stays uniform
    assert sharp[1].max() > base.max() and sharp[1].min() < base.min()
    assert smooth[1].max() < base.max() and smooth[1].min() > base.min()
    for t in (0.5, 1.3):
        ref = hf_probs(scores, TemperatureLogitsWarper(t))
        assert_same(our_probs(scores, temperature=t), ref, scores / np.float32(t))


def test_repetition_penalty_unit_vector():
    scores = np.full((2, 10), 1 / 10, np.float32)
    scores[0, 0] = -1 / 10
    scores[1, 5] = 4 / 10
    out = apply_repetition_penalty(scores, [np.array([0, 1]), np.array([5, 0])], 2.0)
    assert out[0, 0] == np.float32(-1 / 10) * 2 and out[0, 1] == np.float32(1 / 10) / 2
    assert out[1, 0] == np.float32(1 / 10) / 2 and out[1, 5] == np.float32(4 / 10) / 2


def test_min_new_tokens_unit_vector():
    scores = np.full((4, 20), 1 / 20, np.float32)
    for n_generated, banned in ((0, True), (1, True), (2, True), (3, False)):  # prompt of 5, min_new_tokens 3
        out = apply_min_new_tokens(scores, n_generated, 3, (0,))
        assert np.isneginf(out[:, 0]).all() == banned and np.isfinite(out[:, 1:]).all()


def test_min_p_unit_vector():
    probs = [[0.9, 0.0274, 0.047, 0.0274], [0.15, 0.3, 0.3, 0.25], [0.97, 0.01, 0.01, 0.01]]
    dist = np.log(np.array(probs, np.float32))
    kept = our_probs(dist, min_p=0.05) > 0
    assert kept.tolist() == [[True, False, True, False], [True] * 4, [True, False, False, False]]
    ramp = np.tile(np.arange(10, dtype=np.float32) - 5, (2, 1))
    ramp[1] *= 100
    assert ((our_probs(ramp, min_p=0.9) > 0).sum(-1)).tolist() == [1, 1]


def test_typical_p_unit_vector():
    dist = np.log(np.array([[0.97, 0.01, 0.01, 0.01], [0.4, 0.2, 0.2, 0.2]], np.float32))
    kept = our_probs(dist, typical_p=0.5) > 0
    assert kept.tolist() == [[True, False, False, False], [False, True, True, True]]
    assert (our_probs(np.full((2, 5), 0.2, np.float32), typical_p=0.5) > 0).all()  # uniform is not changed
    ramp = np.tile(np.arange(10, dtype=np.float32) - 5, (2, 1))
    ramp[1] *= 100
    assert ((our_probs(ramp, typical_p=0.7) > 0).sum(-1)).tolist() == [2, 1]


def test_no_repeat_ngram_unit_vector():
    scores = np.full((2, 3), 1 / 3, np.float32)
    seen = [np.array([1, 1, 2, 1]), np.array([0, 1, 0, 1])]
    assert np.isinf(apply_no_repeat_ngram(scores, seen, 2)).tolist() == [[False, True, True], [True, False, False]]
    assert np.isinf(apply_no_repeat_ngram(scores, seen, 3)).tolist() == [[False, False, False], [True, False, False]]


def test_bad_words_unit_vector():
    scores = np.full((2, 5), 1 / 5, np.float32)
    seen = [np.array([0, 1, 3, 1]), np.array([0, 1, 0, 1])]
    bad = ((1,), (4,), (1, 0), (0, 1, 2), (1, 3, 1, 3))
    out = apply_bad_words(scores, seen, bad, eos=(4,))  # [4] is EOS: dropped, as transformers does
    assert np.isinf(out).tolist() == [[True, True, False, True, False], [True, True, True, False, False]]
    assert (apply_bad_words(scores, seen, ((4,),), eos=(4,)) == scores).all()


# ---- random inputs against the installed processor classes ----------------------------------------------------


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_top_k_matches_transformers(vocab, kind):
    scores = log_probs(kind, vocab, seed=1)
    for k in (1, 3, 50, vocab - 1, vocab + 5):
        assert_same(our_probs(scores, top_k=k), hf_probs(scores, TopKLogitsWarper(k)), scores)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_top_p_matches_transformers(vocab, kind):
    scores = log_probs(kind, vocab, seed=2)
    for p in (0.1, 0.5, 0.8, 0.9, 0.95, 0.999):
        assert_same_top_p(our_probs(scores, top_p=p), hf_probs(scores, TopPLogitsWarper(p)), scores, p)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_top_k_then_top_p_matches_transformers(vocab, kind):
    scores = log_probs(kind, vocab, seed=12)
    for k, p in ((3, 0.5), (50, 0.9), (vocab // 2, 0.95)):
        ours, ref = our_probs(scores, top_k=k, top_p=p), hf_probs(scores, TopKLogitsWarper(k), TopPLogitsWarper(p))
        masked = np.where(hf_probs(scores, TopKLogitsWarper(k)) > 0, scores, -np.inf).astype(np.float32)
        assert_same_top_p(ours, ref, masked, p)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_temperature_matches_transformers(vocab, kind):
    scores = log_probs(kind, vocab, seed=3)
    for shift in (0.0, -20.0):  # log-probs far below 0 (a flat row over a big vocabulary, or a low temperature)
        shifted = scores + np.float32(shift)
        for t in (0.05, 0.3, 0.7, 1.5, 4.0):
            ref = hf_probs(shifted, TemperatureLogitsWarper(t))
            assert_same(our_probs(shifted, temperature=t), ref, shifted / np.float32(t))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_min_p_matches_transformers(vocab, kind):
    scores = log_probs(kind, vocab, seed=4)
    for m in (0.001, 0.05, 0.2, 0.9, 1.0):
        ours, ref = our_probs(scores, min_p=m), hf_probs(scores, MinPLogitsWarper(m))
        assert_same(ours, ref, scores, min_p_sensitive(scores, m))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_typical_p_matches_transformers(vocab, kind):
    scores = log_probs(kind, vocab, seed=5)
    for m in (0.05, 0.2, 0.5, 0.9, 0.99):
        ours, ref = our_probs(scores, typical_p=m), hf_probs(scores, TypicalLogitsWarper(m))
        assert_same(ours, ref, scores, typical_p_sensitive(scores, m))


@pytest.mark.parametrize("vocab", (10, 50257))
@pytest.mark.parametrize("penalty", (0.7, 1.3, 2.0))
def test_repetition_penalty_matches_transformers(vocab, penalty):
    scores = log_probs("peaked", vocab, seed=6) + np.float32(2)  # positive and negative scores
    seen = np.random.default_rng(0).integers(0, vocab, (3, 30))
    ours = apply_repetition_penalty(scores, list(seen), penalty)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(seen), torch.from_numpy(scores.copy())).numpy()
    assert (ours == ref).all()


@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_no_repeat_ngram_matches_transformers(n):
    rng = np.random.default_rng(n)
    scores = log_probs("peaked", 50257, seed=7)
    for length in (1, 3, 40, 200):
        seen = rng.integers(0, 12, (3, length))  # a small alphabet, so n-grams repeat
        ref = NoRepeatNGramLogitsProcessor(n)(torch.from_numpy(seen), torch.from_numpy(scores.copy())).numpy()
        assert (apply_no_repeat_ngram(scores, list(seen), n) == ref).all()


def test_bad_words_match_transformers():
    rng = np.random.default_rng(8)
    scores = log_probs("peaked", 50257, seed=8)
    for _ in range(20):
        bad = [rng.integers(0, 6, rng.integers(1, 4)).tolist() for _ in range(rng.integers(1, 6))]
        seen = rng.integers(0, 6, (3, rng.integers(1, 8)))
        proc = NoBadWordsLogitsProcessor(bad, eos_token_id=5)
        ref = proc(torch.from_numpy(seen), torch.from_numpy(scores.copy())).numpy()
        assert (apply_bad_words(scores, list(seen), tuple(map(tuple, bad)), eos=(5,)) == ref).all(), bad


@pytest.mark.parametrize("min_new", (0, 1, 4))
def test_min_new_tokens_matches_transformers(min_new):
    scores = log_probs("peaked", 1000, seed=9)
    for n_generated in range(6):
        proc = MinNewTokensLengthLogitsProcessor(5, min_new, [3, 7])
        ref = proc(torch.zeros((3, 5 + n_generated), dtype=torch.long), torch.from_numpy(scores.copy())).numpy()
        assert (apply_min_new_tokens(scores, n_generated, min_new, (3, 7)) == ref).all()


TRAINED = Path("/work/shared/trained-gpt2-py")


@pytest.fixture(scope="module")
def real_logprobs() -> np.ndarray:
    """(16, 50257) next-token log-probs of a small GPT-2 trained on Python source (real, peaked rows)."""
    if not (TRAINED / "model.safetensors").exists():
        pytest.skip("the trained GPT-2 is not in /work/shared")
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(TRAINED).eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 50257, (1, 8)))
    with torch.no_grad():
        for _ in range(24):  # continue greedily: later rows are confident, like real text
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
        logits = model(ids).logits[0, -16:]
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("t", [0.7, 1.0])
def test_every_warper_matches_transformers_on_real_distributions(real_logprobs, t):
    scores = real_logprobs
    scaled = scores / np.float32(t)
    warp = (TemperatureLogitsWarper(t),) if t != 1.0 else ()
    for k in (1, 40):
        assert_same(our_probs(scores, temperature=t, top_k=k), hf_probs(scores, *warp, TopKLogitsWarper(k)), scaled)
    for p in (0.5, 0.9, 0.99):
        assert_same_top_p(our_probs(scores, temperature=t, top_p=p), hf_probs(scores, *warp, TopPLogitsWarper(p)),
                          scaled, p)  # fmt: skip
    for m in (0.02, 0.1):
        ref = hf_probs(scores, *warp, MinPLogitsWarper(m))
        assert_same(our_probs(scores, temperature=t, min_p=m), ref, scaled, min_p_sensitive(scaled, m))
    for m in (0.2, 0.9):
        ref = hf_probs(scores, *warp, TypicalLogitsWarper(m))
        assert_same(our_probs(scores, temperature=t, typical_p=m), ref, scaled, typical_p_sensitive(scaled, m))
