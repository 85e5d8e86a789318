"""next_tokens end to end: the processors in transformers' order (checked against transformers' own
`_get_logits_processor`), greedy and seeded sampling, and SamplingParams' checks. Each processor alone is
compared with transformers in test_processors.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.decoding.sampling import SamplingParams, apply_processors, next_tokens, sample_index, warp_row

V = 2000
EOS = 7


def random_logprobs(seed: int, batch: int = 3, vocab: int = V, scale: float = 3.0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((batch, vocab)) * scale
    x -= np.log(np.exp(x).sum(-1, keepdims=True))
    return x.astype(np.float32)


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 8, "do_sample": True, **kw})


def transformers_processors(vocab: int, prompt_len: int, p: SamplingParams):
    """The LogitsProcessorList transformers' generate() would build for these options (its order, its classes)."""
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=1, n_embd=4, vocab_size=vocab))
    options = {k: getattr(p, k) for k in ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p")}
    config = GenerationConfig(
        **options,
        repetition_penalty=p.repetition_penalty,
        no_repeat_ngram_size=p.no_repeat_ngram_size,
        bad_words_ids=[list(s) for s in p.bad_words_ids] or None,
        min_new_tokens=p.min_new_tokens,
        eos_token_id=list(p.eos_token_id),
    )
    model._prepare_special_tokens(config, kwargs_has_attention_mask=False, device="cpu")
    return model._get_logits_processor(config, input_ids_seq_length=prompt_len, device="cpu")


def our_distribution(scores: np.ndarray, p: SamplingParams, history: np.ndarray, n_generated: int) -> np.ndarray:
    processed = apply_processors(scores, p, list(history), n_generated)
    dense = np.zeros_like(scores)
    for b, row in enumerate(processed):
        ids, probs = warp_row(row, p)
        dense[b, ids] = probs
    return dense


PIPELINES = [
    dict(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.3),
    dict(temperature=1.3, top_k=0, top_p=0.95, min_p=0.02, no_repeat_ngram_size=2),
    dict(temperature=0.9, top_k=200, typical_p=0.9, min_p=0.05, bad_words_ids=((5,), (11, 12), (EOS,))),
    dict(temperature=0.5, top_k=0, top_p=0.8, typical_p=0.5, min_new_tokens=4, repetition_penalty=0.8),
    dict(top_k=40, min_p=0.1, no_repeat_ngram_size=1, bad_words_ids=((3, 4, 5),), min_new_tokens=2),
]


@pytest.mark.parametrize("vocab", [V, 50257])
@pytest.mark.parametrize("options", PIPELINES)
def test_pipeline_matches_transformers_generate_order(vocab, options):
    p = params(eos_token_id=(EOS,), **options)
    rng = np.random.default_rng(1)
    history = rng.integers(0, 20, (3, 12))  # a small alphabet: n-grams and bad-word prefixes recur
    history[:, -2:] = [11, 3]  # ... and (11, 12) / (3, 4, 5) may complete
    history[1, -2:] = [3, 4]
    processors = transformers_processors(vocab, prompt_len=10, p=p)  # so 2 tokens are new
    for seed in range(3):
        scores = random_logprobs(seed, vocab=vocab)
        ref = torch.softmax(processors(torch.from_numpy(history), torch.from_numpy(scores.copy())), -1).numpy()
        ours = our_distribution(scores, p, history, n_generated=2)
        assert ((ours > 0) == (ref > 0)).all()
        assert np.abs(ours - ref).max() < 1e-6


def test_greedy_is_argmax_after_the_processors():
    p = SamplingParams(do_sample=False, repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=3,
                       bad_words_ids=((9,),), eos_token_id=(EOS,))  # fmt: skip
    history = np.random.default_rng(2).integers(0, 20, (3, 12))
    processors = transformers_processors(V, prompt_len=11, p=p)
    for seed in range(5):
        scores = random_logprobs(seed, scale=0.3)
        scores[:, [EOS, 9, int(history[0, -1])]] += 5.0  # the favourites are all banned or penalised
        ref = processors(torch.from_numpy(history), torch.from_numpy(scores.copy())).argmax(-1).numpy()
        assert (next_tokens(scores, p, list(history), 1, np.random.default_rng(0)) == ref).all()


def test_same_seed_same_tokens_and_different_seed_differs():
    logits = random_logprobs(3, scale=0.5)
    seen = [np.array([1])] * 3
    draw = lambda seed: next_tokens(logits, params(seed=seed, top_k=0), seen, 0, np.random.default_rng(seed))
    assert (draw(5) == draw(5)).all()
    assert any((draw(5) != draw(s)).any() for s in range(6, 10))


def test_temperature_zero_and_do_sample_false_are_greedy():
    logits = random_logprobs(4)
    seen = [np.array([1])] * 3
    rng = np.random.default_rng(0)
    greedy = logits.argmax(-1)
    assert (next_tokens(logits, params(temperature=0.0), seen, 0, rng) == greedy).all()
    assert (next_tokens(logits, params(do_sample=False, temperature=3.0), seen, 0, rng) == greedy).all()
    assert (next_tokens(logits, params(top_k=1, temperature=2.0), seen, 0, rng) == greedy).all()


def test_top_k_one_samples_among_tied_best_like_transformers():
    logits = np.full((1, 6), -5.0, np.float32)
    logits[0, [2, 4]] = -1.0  # two tokens tie for best: TopK(1) keeps both
    draws = {
        int(next_tokens(logits, params(top_k=1), [np.array([0])], 0, np.random.default_rng(s))[0]) for s in range(40)
    }
    assert draws == {2, 4}


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
    ids, probs = warp_row(logits[0], p)
    expected = np.zeros(7)
    expected[ids] = probs
    rng = np.random.default_rng(123)
    n = 20000
    draws = np.array([next_tokens(logits, p, [np.array([0])], 0, rng)[0] for _ in range(n)])
    counts = np.bincount(draws, minlength=7)
    assert counts[expected == 0].sum() == 0, "sampled a filtered-out token"
    keep = expected > 0
    f_exp = expected[keep] / expected[keep].sum() * n  # float64, sums to n exactly as scipy requires
    _, pvalue = stats.chisquare(counts[keep], f_exp)
    assert pvalue > 1e-3, f"sampling does not follow the filtered distribution (p={pvalue:.2g})"


class AlmostOne:
    """A Generator stand-in whose uniform draw is as close to 1 as a float gets: the draw lands at the very end."""

    def random(self) -> float:
        return 1 - 2**-53


@pytest.mark.parametrize("n", [7, 50257])  # the short path and the block-by-block one
def test_sample_index_follows_probs_and_never_draws_a_zero(n):
    probs = np.zeros(n, np.float32)
    heavy = [1, n // 2, n - 2]  # the last id has probability 0
    probs[heavy] = [0.5, 0.3, 0.2]
    rng = np.random.default_rng(7)
    draws = np.array([sample_index(probs, rng) for _ in range(3000)])
    counts = np.array([(draws == i).sum() for i in heavy])
    assert counts.sum() == len(draws), "drew a token of probability 0"
    assert stats.chisquare(counts, np.array([0.5, 0.3, 0.2]) * len(draws)).pvalue > 1e-3
    assert sample_index(probs, AlmostOne()) == n - 2  # past the end by rounding: the last possible token


def test_a_row_with_every_token_banned_is_a_clear_error():
    p = params(no_repeat_ngram_size=1)  # a 1-gram ban: every token seen so far
    with pytest.raises(GenerationError, match="No token is left to sample"):
        next_tokens(random_logprobs(0, vocab=6), p, [np.arange(6)] * 3, 0, np.random.default_rng(0))


def test_history_is_needed_exactly_when_a_processor_reads_it():
    assert not SamplingParams().uses_history
    assert not SamplingParams(bad_words_ids=[[5]], top_k=3, min_p=0.1).uses_history  # one-token bans: no history
    assert SamplingParams(repetition_penalty=1.1).uses_history
    assert SamplingParams(no_repeat_ngram_size=3).uses_history
    assert SamplingParams(bad_words_ids=[[5, 6]]).uses_history


def test_bad_words_ids_are_normalised_and_checked_against_the_vocabulary():
    p = SamplingParams(bad_words_ids=[[5, 6], [np.int64(7)]])
    assert p.bad_words_ids == ((5, 6), (7,))
    with pytest.raises(GenerationError, match=r"bad_words_ids holds token id\(s\) \[2000\].*2000 tokens"):
        next_tokens(random_logprobs(0), SamplingParams(bad_words_ids=[[2000]]), [np.array([1])] * 3, 0, None)


@pytest.mark.parametrize(
    "kw, phrase",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": "hot"}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.2}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"min_new_tokens": -2}, "min_new_tokens must be an integer >= 0"),
        ({"min_p": 0.0}, "min_p must be in (0, 1]"),
        ({"min_p": 1.5}, "min_p must be in (0, 1]"),
        ({"min_p": float("nan")}, "min_p must be in (0, 1]"),
        ({"typical_p": 0.0}, "typical_p must be in (0, 1]"),
        ({"typical_p": -0.2}, "typical_p must be in (0, 1]"),
        ({"typical_p": 1.01}, "typical_p must be in (0, 1]"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be an integer >= 0"),
        ({"no_repeat_ngram_size": 1.5}, "no_repeat_ngram_size must be an integer >= 0"),
        ({"bad_words_ids": [[]]}, "bad_words_ids must be a list of non-empty lists of token ids"),
        ({"bad_words_ids": [5, 6]}, "bad_words_ids must be a list of non-empty lists of token ids"),
        ({"bad_words_ids": [[5, -1]]}, "bad_words_ids must be a list of non-empty lists of token ids"),
        ({"bad_words_ids": [["hello"]]}, "bad_words_ids must be a list of non-empty lists of token ids"),
        ({"bad_words_ids": "hello"}, "bad_words_ids must be a list of non-empty lists of token ids"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"seed": 1.5}, "seed must be an integer >= 0"),
        ({"seed": "7"}, "seed must be an integer >= 0"),
    ],
)
def test_invalid_parameters_are_clear_errors(kw, phrase):
    escaped = phrase.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]").replace("[", r"\[")
    with pytest.raises(GenerationError, match=escaped):
        SamplingParams(**kw)


def test_valid_edge_values_are_accepted():
    SamplingParams(min_p=1.0, typical_p=1.0, top_p=1.0, seed=0, no_repeat_ngram_size=0, bad_words_ids=())
    SamplingParams(seed=2**64 + 1, top_k=np.int64(5), temperature=np.float32(0.5))
