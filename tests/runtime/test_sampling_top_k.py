"""scaled_top_k (temperature and top-k on a candidate pool) gives the arrays the two warpers give on the whole row."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2edge.runtime.decoding import sampling
from gpt2edge.runtime.decoding.sampling import SamplingParams, sample_row
from gpt2edge.runtime.decoding.top_k import apply_temperature, apply_top_k, scaled_top_k, top_k_pool

TEMPERATURES = (1e-30, 1e-3, 0.3, 0.7, 0.8, 1.0, 1.3, 3.7, 100.0, 1e30)


def full_path(row: np.ndarray, t: float, k: int):
    return apply_top_k(None, apply_temperature(row, t), k)


def rows(rng: np.random.Generator) -> list[np.ndarray]:
    """Log-prob-like rows (flat and peaked), with -inf ids, and rows built so that scores a few ulps below the
    k-th round onto its quotient."""
    out = []
    for scale in (0.1, 3.0, 30.0):
        x = (rng.standard_normal(5000) * scale).astype(np.float32)
        out.append(x - np.float32(np.log(np.exp(x.astype(np.float64)).sum())))
    banned = out[1].copy()
    banned[rng.choice(5000, 4990, replace=False)] = -np.inf  # fewer finite scores than k: the full path
    out.append(banned)
    for base in (-3.0, -11.7, -0.37):  # the 50th score, then neighbours one and two ulps below it
        x = (rng.uniform(-40, -20, 5000)).astype(np.float32)
        x[:49] = np.float32(-1.0)
        kth = np.float32(base)
        x[100:103] = kth
        x[200:204] = np.nextafter(kth, -np.inf)
        x[300:304] = np.nextafter(np.nextafter(kth, -np.inf), -np.inf)
        out.append(x)
    return out


@pytest.mark.parametrize("t", TEMPERATURES)
@pytest.mark.parametrize("k", (1, 5, 50, 400))
def test_scaled_top_k_is_temperature_then_top_k(t, k):
    rng = np.random.default_rng(7)
    for row in rows(rng):
        fast = scaled_top_k(row, t, k)
        ids, vals = full_path(row, t, k)
        if fast is None:
            continue
        assert np.array_equal(fast[0], ids), (t, k)
        assert np.array_equal(fast[1], vals), (t, k)
        assert fast[1].dtype == np.float32


def test_scaled_top_k_takes_the_fast_path_and_the_rounding_ties():
    """The pool path runs on ordinary rows, and a score below the k-th whose quotient rounds onto the k-th's is
    kept (TopK keeps ties with the k-th) though the raw row's top-k pool leaves it out."""
    rng = np.random.default_rng(7)
    taken, widened = 0, 0
    for t in TEMPERATURES:
        for row in rows(rng):
            fast = scaled_top_k(row, t, 50)
            if fast is not None:
                taken += 1
                widened += len(fast[0]) > len(top_k_pool(row, 50))
    assert taken >= 40 and widened >= 1, (taken, widened)
    assert scaled_top_k(np.zeros(10, np.float32), 0.8, 0) is None  # no top-k: the full path
    assert scaled_top_k(np.zeros(10, np.float32), 0.8, 10) is None  # k covers the row


@pytest.mark.parametrize("t", (0.3, 0.8, 1.3, 3.7))
def test_sampled_tokens_unchanged(monkeypatch, t):
    """Seeded draws through sample_row (top-k, then top-p) are the ones the whole-row warpers give."""
    rng = np.random.default_rng(1)
    params = SamplingParams(do_sample=True, temperature=t, top_k=40, top_p=0.9)
    data = rows(rng)
    fast = [sample_row(r, params, np.random.default_rng(i)) for i, r in enumerate(data)]
    monkeypatch.setattr(sampling, "scaled_top_k", lambda row, temperature, k: None)
    full = [sample_row(r, params, np.random.default_rng(i)) for i, r in enumerate(data)]
    assert fast == full
