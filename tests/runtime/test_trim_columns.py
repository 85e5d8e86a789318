"""Sampling on a vocabulary-trimmed head's K columns (runtime/columns.py) against the full (V,) row with -inf at
the dropped ids, which is what generation ran on before: the processors (full ids in, columns touched), every
warper path of the sampler (a top-k pool, or the whole row), the seeded draw and its RNG consumption, greedy,
a beam step and a logprobs record must all come out bit-identical, with full token ids."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2edge.runtime.decoding.beam_search import BeamSearch
from gpt2edge.runtime.decoding.logprobs import LogprobRecorder
from gpt2edge.runtime.decoding.sampling import SamplingParams, apply_processors, next_tokens, softmax, warp_row
from gpt2edge.runtime.model.columns import Columns

EOS = 5


def setup(V: int, K: int, seed: int = 0, scale: float = 3.0, batch: int = 3):
    """Columns of K kept ids (EOS among them) and a (batch, V) full row of renormalised log-probs, -inf at the
    dropped ids, with its (batch, K) columns."""
    rng = np.random.default_rng(seed)
    kept = np.union1d([EOS], rng.choice(np.delete(np.arange(V), EOS), K - 1, replace=False))  # (K,)
    columns = Columns.of(kept, V)
    x = rng.standard_normal((batch, K)) * scale
    x -= np.log(np.exp(x).sum(-1, keepdims=True))
    cols = x.astype(np.float32)
    return columns, columns.full(cols), cols


def dropped(columns: Columns, n: int) -> list[int]:
    return np.setdiff1d(np.arange(columns.vocab_size), columns.ids)[:n].tolist()


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 8, "do_sample": True, "eos_token_id": (EOS,), **kw})


def test_columns_map_ids_both_ways():
    c = Columns.of(np.array([0, 3, 7, 9]), 12)
    assert c.cols([9, 1, 3, 3, 11, 12, -1]).tolist() == [3, 1, 1]  # dropped, past-V and negative ids: no column
    assert c.ids[c.cols([0, 7])].tolist() == [0, 7]
    row = np.array([-1.0, -2.0, -3.0, -4.0], np.float32)
    assert c.value(row, 7) == -3.0 and c.value(row, 5) == -np.inf
    assert c.full(row[None]).shape == (1, 12) and np.isneginf(c.full(row[None])[0, [1, 2, 4]]).all()


def histories(columns: Columns) -> list[np.ndarray]:
    """Histories full of dropped ids, so n-grams, bad-word prefixes and seen ids are partly outside the columns."""
    d, k = dropped(columns, 3), columns.ids[1:6].tolist()
    return [
        np.array([d[0], k[0], d[1], k[0], d[0], k[0], d[1]]),  # (d1 -> k0) and (d0 -> k0): bans k0 after d1
        np.array([k[1], d[2], k[1], d[2], k[1]]),  # bans the dropped d2 after k1
        np.array([k[2], k[3], EOS, k[2], k[3]]),
    ]


def test_processors_on_columns_equal_the_full_row_restricted():
    for V, K in ((400, 300), (50257, 8192)):
        columns, full, cols = setup(V, K, seed=1)
        seen = histories(columns)
        d, k = dropped(columns, 2), columns.ids[1:6].tolist()
        bad = ((d[0],), (k[4],), (k[1], d[1]), (k[3], EOS), (d[1], k[2]), (EOS,))
        p = params(repetition_penalty=1.7, no_repeat_ngram_size=2, bad_words_ids=bad, min_new_tokens=3)
        ours = apply_processors(cols, p, seen, 1, columns)
        ref = apply_processors(full, p, seen, 1)
        assert np.array_equal(ours, ref[:, columns.ids])  # bit-identical on the kept ids
        assert np.isneginf(np.delete(ref, columns.ids, axis=1)).all()  # the dropped ones stay impossible
        assert np.isneginf(ours[:, columns.cols([EOS, k[4]])]).all()  # EOS (min_new_tokens) and a bad word
        assert np.isneginf(ours[0, columns.cols([k[0]])]).all() and np.isneginf(ours[2, columns.cols([EOS])])
        assert (ours < cols)[0, columns.cols(seen[0])].all()  # seen: penalised (or banned)


def test_processors_refuse_ids_past_the_full_vocabulary_not_past_k():
    columns, _, cols = setup(400, 300)
    apply_processors(cols, params(bad_words_ids=((399,),)), [np.array([1])], 0, columns)  # < V: fine on K columns
    with pytest.raises(Exception, match="vocabulary has 400 tokens"):
        apply_processors(cols, params(bad_words_ids=((400,),)), [np.array([1])], 0, columns)


def sampling_grid(V: int, K: int) -> list[dict]:
    return [
        dict(top_k=50),  # a top-k pool: no dropped id in it
        dict(top_k=50, temperature=0.7, top_p=0.9),
        dict(top_k=5, typical_p=0.8, min_p=0.1),
        dict(top_k=0),  # the whole row, drawn at once
        dict(top_k=0, temperature=1.3),
        dict(top_k=0, top_p=0.9),  # top-p on the whole row
        dict(top_k=0, top_p=0.3, temperature=0.6),
        dict(top_k=0, min_p=0.05),
        dict(top_k=0, min_p=1e-45),  # its threshold underflows to 0: the whole row survives min-p
        dict(top_k=0, typical_p=0.9),
        dict(top_k=0, typical_p=0.2, temperature=2.0),
        dict(top_k=0, top_p=0.95, min_p=0.02, typical_p=0.9),
        dict(top_k=K),  # k = K: every kept token, no dropped one
        dict(top_k=K + 1, top_p=0.97),  # k > K: the full row's k-th score is -inf
        dict(top_k=V - 1, typical_p=0.95),
        dict(temperature=1e-45, top_k=0),  # every score overflows: the best token(s)
    ]


@pytest.mark.parametrize("V,K", [(400, 300), (50257, 8192), (50257, 4000)])
def test_sampling_on_columns_draws_the_full_rows_token_with_the_same_random_numbers(V, K):
    for scale in (0.5, 3.0):
        columns, full, cols = setup(V, K, seed=int(scale * 10), scale=scale)
        seen = [np.array([1, 2])] * len(cols)
        for kw in sampling_grid(V, K):
            p = params(**kw)
            for seed in range(4):
                a, b = np.random.default_rng(seed), np.random.default_rng(seed)
                ours = next_tokens(cols, p, seen, 5, a, columns)
                ref = next_tokens(full, p, seen, 5, b)
                assert ours.tolist() == ref.tolist(), (kw, seed)
                assert a.random() == b.random()  # the same random numbers were consumed
                assert set(ours.tolist()) <= set(columns.ids.tolist())


def test_banned_kept_tokens_leave_fewer_than_top_k_possible():
    """Bans that leave 30 kept tokens: a top-k of 50 keeps the whole row (its k-th score is -inf)."""
    columns, full, cols = setup(400, 300, seed=3)
    bad = tuple((int(i),) for i in columns.ids[30:] if i != EOS)
    seen = [np.array([1])] * 3
    for kw in (dict(top_k=50), dict(top_k=50, top_p=0.9), dict(top_k=30), dict(top_k=20, typical_p=0.9)):
        p = params(bad_words_ids=bad, **kw)
        for seed in range(6):
            a, b = np.random.default_rng(seed), np.random.default_rng(seed)
            assert next_tokens(cols, p, seen, 0, a, columns).tolist() == next_tokens(full, p, seen, 0, b).tolist()
            assert a.random() == b.random()


class FixedUniform:
    """A generator whose one draw is a chosen uniform."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def boundary_uniforms(full_row: np.ndarray, n: int) -> list[float]:
    """Uniforms whose target lands exactly on a CDF step of the full row's draw (sample_index's blocks of 1024
    over the V ids): where the last bit of a sum decides the token."""
    probs = softmax(full_row)
    blocks = np.zeros(-(-probs.size // 1024) * 1024)
    blocks[: probs.size] = probs
    blocks = blocks.reshape(-1, 1024)
    block_cdf = np.cumsum(blocks.sum(1))
    out = []
    for j in np.random.default_rng(0).choice(np.flatnonzero(probs > 0), n, replace=False):
        b, off = divmod(int(j), 1024)
        edge = (block_cdf[b - 1] if b else 0.0) + np.cumsum(blocks[b])[off]
        u = edge / block_cdf[-1]
        for _ in range(50):  # the float64 u whose u * total is that step exactly
            if u * block_cdf[-1] == edge:
                break
            u = np.nextafter(u, np.inf if u * block_cdf[-1] < edge else -np.inf)
        out.append(float(u))
    return out


WHOLE_ROW = [dict(top_k=0), dict(top_k=9000), dict(top_k=0, min_p=1e-45), dict(top_k=0, typical_p=1 - 1e-9)]


@pytest.mark.parametrize("kw", WHOLE_ROW)
@pytest.mark.parametrize("K", [8192, 3000])
def test_whole_row_draws_match_even_on_a_cdf_step(K, kw):
    """The K columns' own sums group differently from the full row's (NumPy sums pairwise, the dropped ids'
    zeros shift the tree; K <= 4096 would not even use blocks): on a CDF step their last bit picks the token.
    Taken in the full row's layout, the draw is the full row's at every step tried. (Top-k above K, a min-p
    threshold that underflows to 0 and a typical mass the row cannot reach all leave the whole row.)"""
    columns, full, cols = setup(50257, K, seed=9, batch=1)
    p, seen = params(**kw), [np.array([1])]
    for u in boundary_uniforms(full[0], 40):
        ours = next_tokens(cols, p, seen, 0, FixedUniform(u), columns)
        assert ours.tolist() == next_tokens(full, p, seen, 0, FixedUniform(u)).tolist(), u


@pytest.mark.parametrize("kw", [dict(top_k=50, top_p=0.9), dict(top_k=0, top_p=0.9), dict(top_k=0, typical_p=0.5)])
def test_warp_row_on_columns_gives_the_full_rows_distribution_bit_for_bit(kw):
    columns, full, cols = setup(50257, 8192, seed=4)
    ids, probs = warp_row(cols[0], params(**kw), columns)
    ref_ids, ref_probs = warp_row(full[0], params(**kw))
    possible = ref_probs > 0  # the full row's whole-row result also lists the dropped ids, at probability 0
    assert ids[probs > 0].tolist() == ref_ids[possible].tolist()
    assert np.array_equal(probs[probs > 0], ref_probs[possible])


def test_greedy_on_columns_returns_full_ids_and_the_full_rows_choice():
    columns, full, cols = setup(50257, 8192, seed=5)
    seen = histories(columns)
    for kw in (dict(), dict(repetition_penalty=2.0, no_repeat_ngram_size=2, min_new_tokens=4)):
        p = params(do_sample=False, **kw)
        assert next_tokens(cols, p, seen, 0, None, columns).tolist() == next_tokens(full, p, seen, 0, None).tolist()
    # every token banned: the full row's argmax is id 0 (its first), so it stays 0 even where id 0 is dropped
    c = Columns.of(np.array([3, 5, 9]), 12)
    banned = np.full((1, 3), -np.inf, np.float32)
    assert next_tokens(banned, params(do_sample=False), [np.array([1])], 0, None, c).tolist() == [0]


def test_beam_step_on_columns_picks_the_full_rows_candidates():
    columns, full, cols = setup(400, 300, seed=6, batch=2 * 3)  # 2 prompts x 3 beams

    def stopped(seqs):
        return seqs[:, :, -1] == EOS

    runs = []
    for lp, c in ((cols, columns), (full, None)):
        beams = BeamSearch(2, 3, max_new_tokens=4, n_eos=1)
        out = [beams.step(lp, stopped, c) for _ in range(3)]
        runs.append((out, beams.running_scores, beams.scores))
    (ours, run_a, hyp_a), (ref, run_b, hyp_b) = runs
    assert all(np.array_equal(x, y) for a, b in zip(ours, ref) for x, y in zip(a, b))
    assert np.array_equal(run_a, run_b) and np.array_equal(hyp_a, hyp_b)
    # a step with fewer possible candidates than K (2 * 3 = 6 per prompt) fills up with -inf ones as the full
    # row does: lowest (beam, id) first, dropped ids included
    sparse = np.full_like(cols, -np.inf)
    sparse[:, :2] = cols[:, :2]
    sparse[1:3] = -np.inf  # beams 1, 2 of prompt 0: nothing possible
    a, b = BeamSearch(2, 3, 4, 1), BeamSearch(2, 3, 4, 1)
    for x, y in zip(a.step(sparse, stopped, columns), b.step(columns.full(sparse), stopped)):
        assert np.array_equal(x, y)


class _Tok:
    """What LogprobRecorder asks of a tokenizer, without one."""

    class _tok:
        decoder = None

        @staticmethod
        def id_to_token(i):
            return None

    @staticmethod
    def decode(ids, skip_special_tokens=False):
        return f"<{ids[0]}>"


@pytest.mark.parametrize("n", [0, 3, 300, 400])
def test_logprobs_record_on_columns_equals_the_full_rows(n):
    columns, full, cols = setup(400, 300, seed=7, batch=2)
    cols[0, 10] = cols[0, 11] = cols[0].max()  # a three-way tie for best: ordered by id either way
    full = columns.full(cols)
    tokens = np.array([columns.ids[3], dropped(columns, 1)[0]])  # the second: a dropped id (greedy, all banned)
    records = []
    for lp, c in ((cols, columns), (full, None)):
        rec = LogprobRecorder(_Tok(), n, 2)
        records.append(rec.record(lp, tokens, [True, True], c))
    assert records[0] == records[1]
    assert records[0][1].logprob == -np.inf and len(records[0][0].top_logprobs) == min(n, 300)
