"""The JS sampler (web/src/sampler.js, rng.js) against the NumPy one on shared vectors generated here from
gpt2edge.runtime's sampler: the same kept token sets, probabilities within 1e-6, the same greedy ids, and,
for a seed, the same uniforms (bit for bit) and the same drawn tokens. Needs node (no browser)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from gpt2edge.runtime.decoding.processors import apply_processors
from gpt2edge.runtime.decoding.sampling import SamplingParams, next_tokens, sample_row, warp_row
from tests.support.web_helpers import WEB

# skipped only outside CI (CI=true, as .ci/run runs): there a missing node fails instead
pytestmark = pytest.mark.skipif(
    not os.environ.get("CI") and shutil.which("node") is None, reason="node is not installed"
)

# (vocab, temperature, top_k, top_p, min_p, repetition_penalty): every warper alone and together, short rows
# (one cumulative sum) and long ones (block-wise draw, float32->float64 sums over several NumPy buffers)
GRID = [
    (64, 1.0, 0, 1.0, None, 1.0),
    (64, 0.7, 0, 0.9, None, 1.3),
    (400, 1.3, 50, 1.0, None, 1.0),
    (400, 1.0, 50, 0.8, None, 1.0),
    (400, 0.8, 0, 0.5, 0.05, 1.2),
    (400, 1.0, 1, 1.0, None, 1.0),
    (5000, 1.0, 0, 1.0, None, 1.0),
    (5000, 0.9, 40, 0.95, None, 1.1),
    (5000, 1.1, 0, 0.7, None, 1.0),
    (50257, 1.0, 50, 1.0, None, 1.0),
    (50257, 1.0, 0, 1.0, None, 1.0),
    (50257, 0.8, 0, 0.9, None, 1.3),
    (50257, 1.0, 0, 1.0, 0.1, 1.0),
    (50257, 1.2, 100, 0.6, None, 1.0),
]
DRAWS = 16


def _row(rng: np.random.Generator, vocab: int, i: int) -> np.ndarray:
    """A log-prob row: peaked or flat, with ties (i % 3 == 2) so the ties rules are exercised."""
    logits = rng.standard_normal(vocab) * (1.0 + 2.0 * (i % 2))
    if i % 3 == 2:
        logits = np.round(logits, 1)
    return (logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()).astype(np.float32)


def _cases():
    rng = np.random.default_rng(7)
    cases = []
    for i, (vocab, t, k, p, min_p, rep) in enumerate(GRID):
        row = _row(rng, vocab, i)
        seen = sorted(rng.choice(vocab, size=12, replace=False).tolist())
        params = SamplingParams(do_sample=True, temperature=t, top_k=k, top_p=p, min_p=min_p, repetition_penalty=rep)
        cases.append((row, seen, params, 1000 + i))
    return cases


def _allowed(vocab: int, i: int) -> np.ndarray:
    """A constraint's allowed ids for case i: a random third of the row, a handful, or every token."""
    rng = np.random.default_rng(100 + i)
    if i % 3 == 0:
        return np.flatnonzero(rng.random(vocab) < 0.3)
    if i % 3 == 1:
        return np.sort(rng.choice(vocab, size=min(5, vocab), replace=False))
    return np.arange(vocab)


@pytest.fixture(scope="module")
def js_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vectors")
    cases = [
        {
            "row": row.tolist(),
            "seen": seen,
            "seed": seed,
            "draws": DRAWS,
            "params": {
                "temperature": p.temperature,
                "top_k": p.top_k,
                "top_p": p.top_p,
                "min_p": p.min_p,
                "repetition_penalty": p.repetition_penalty,
            },
            "allowed": _allowed(len(row), i).tolist(),
        }  # fmt: skip
        for i, (row, seen, p, seed) in enumerate(_cases())
    ]
    seeds = [0, 1, 42, 2**32 - 1, 2**32, 2**63 + 12345, 2**128 + 7]
    uniforms = {"seeds": [str(s) for s in seeds], "n": 64}  # strings: JSON numbers are doubles in JS
    (tmp / "in.json").write_text(json.dumps({"cases": cases, "uniforms": uniforms}))
    subprocess.run(["node", "test/sampler_vectors.mjs", str(tmp / "in.json"), str(tmp / "out.json")], cwd=WEB,
                   check=True, timeout=120)  # fmt: skip
    return json.loads((tmp / "out.json").read_text())


def test_uniforms_bit_identical(js_results):
    """rng.js is np.random.default_rng(seed).random(): the same doubles, bit for bit, for any seed size."""
    for seed, values in js_results["uniforms"].items():
        assert values == np.random.default_rng(int(seed)).random(64).tolist(), seed


@pytest.mark.parametrize("i", range(len(GRID)))
def test_kept_sets_and_probabilities(js_results, i):
    row, seen, params, _ = _cases()[i]
    scores = apply_processors(row[None], params, [np.array(seen)], 0)[0]
    ids, probs = warp_row(scores, params)
    js = js_results["cases"][i]
    py = dict(zip(ids.tolist(), probs.tolist()))
    got = dict(zip(js["ids"], js["probs"]))
    assert set(got) == set(py), f"kept sets differ: {len(got)} vs {len(py)} tokens"
    worst = max(abs(got[t] - py[t]) for t in py)
    assert worst <= 1e-6, worst
    assert js["greedy"] == int(scores.argmax())


@pytest.mark.parametrize("i", range(len(GRID)))
def test_seeded_draws_identical(js_results, i):
    """One seeded generator, DRAWS tokens: the JS draw walks the same uniform through the same CDF."""
    row, seen, params, seed = _cases()[i]
    scores = apply_processors(row[None], params, [np.array(seen)], 0)[0]
    rng = np.random.default_rng(seed)
    py = [sample_row(scores, params, rng) for _ in range(DRAWS)]
    assert js_results["cases"][i]["draws"] == py


def test_generator_loop_in_node(tiny_checkpoint):
    """web/test/generator.test.mjs: Stop, EOS (and ignore_eos), stop strings, the length rule, with a stand-in
    model; none may be skipped (the tokenizer is given)."""
    env = {**os.environ, "TOKENIZER": str(tiny_checkpoint / "tokenizer.json")}
    proc = subprocess.run(["node", "--test", "test/generator.test.mjs"], cwd=WEB, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "# pass 4" in proc.stdout and "# skipped 0" in proc.stdout


@pytest.mark.parametrize("i", range(len(GRID)))
def test_constraint_mask_sits_where_python_puts_it(js_results, i):
    """nextToken(..., allowed): the mask after the repetition penalty and before the warpers, as
    gpt2edge.runtime.decoding.sampling.next_tokens(allowed=) applies it: the same greedy id and, for a seed, the
    same draws (a third of the row allowed, five tokens, or every token: then the unmasked draws)."""
    row, seen, params, seed = _cases()[i]
    mask = np.zeros(len(row), dtype=bool)
    mask[_allowed(len(row), i)] = True
    rng = np.random.default_rng(seed)
    py = [int(next_tokens(row[None], params, [np.array(seen)], 0, rng, allowed=mask[None])[0]) for _ in range(DRAWS)]
    js = js_results["cases"][i]
    assert js["masked_draws"] == py and all(mask[t] for t in py)
    greedy = SamplingParams(do_sample=False, repetition_penalty=params.repetition_penalty)
    assert js["masked_greedy"] == int(next_tokens(row[None], greedy, [np.array(seen)], 0, rng, allowed=mask[None])[0])
    if mask.all():
        assert js["masked_draws"] == js["draws"]
