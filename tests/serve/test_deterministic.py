"""Rows that do not depend on the traffic (serve --deterministic, Generator(deterministic=True)): a request served
among mixed traffic gets exactly the tokens and, bit for bit, the next-token log-probs it gets alone, at fp32,
int8 (MatMulNBits and DynamicQuantizeMatMul) and int4, on both graph kinds; and the default batched path is
shown to differ, so the comparison can fail."""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import numpy as np
import pytest

from gpt2edge.runtime import Generator
from gpt2edge.serve import ServeConfig
from gpt2edge.serve.scheduling.batch import take_batch
from gpt2edge.serve.scheduling.continuous import ContinuousScheduler
from gpt2edge.serve.scheduling.jobs import Job, Sampling

PROMPTS = [
    "The river rose and",
    "Children learned to swim before they could read, and the old harbour wall at dusk was",
    "A",
    "Visitors walk along the old harbour wall at dusk while",
    "Snow fell on the quiet hills",
]
# greedy and seeded sampled requests of different prompt and output lengths; one seeded request has n = 2
# and a request of two prompts whose lengths differ (under aligned batching it can only run by itself)
TRAFFIC = [
    ((0,), 14, 1, dict(temperature=0)),
    ((1,), 9, 1, dict(temperature=1.0, top_p=0.9, seed=7)),
    ((2,), 17, 1, dict(temperature=0)),
    ((3,), 11, 2, dict(temperature=1.2, seed=11)),
    ((4,), 6, 1, dict(temperature=0)),
    ((0, 2), 7, 1, dict(temperature=0)),
    ((1,), 12, 1, dict(temperature=0)),
]


@pytest.fixture(scope="module")
def variants(tiny_export, tiny_export_shared, tmp_path_factory) -> dict:
    """fp32, int8 (the default MatMulNBits and DynamicQuantizeMatMul: one activation scale per batch) and int4
    variants of both graph kinds."""
    pytest.importorskip("onnx")
    from gpt2edge.quantize.handler import quantize_model
    from gpt2edge.quantize.recipe import make_recipe

    root = tmp_path_factory.mktemp("determ")
    recipes = {
        "int8": make_recipe("int8"),
        "int8dq": dataclasses.replace(make_recipe("int8"), int8_op="DynamicQuantizeMatMul"),
        "int4": make_recipe("int4"),
    }
    out = {}
    for kind, src in (("concat", tiny_export), ("shared", tiny_export_shared)):
        out[f"fp32-{kind}"] = src
        for name, recipe in recipes.items():
            quantize_model(src, root / f"{name}-{kind}", recipe, report=False)
            out[f"{name}-{kind}"] = root / f"{name}-{kind}"
    return out


def serve(gen: Generator, traffic, deterministic: bool) -> dict[int, list]:
    """Submit the requests at once to a continuous scheduler; {request: per row, [(token, (1, W) log-probs)]}."""
    sched = ContinuousScheduler(gen, ServeConfig(model_name="t", max_batch=8, deterministic=deterministic))
    seen: dict[tuple[int, int], list] = {}
    take = sched._take

    def spy(live, i, token, scores):  # each token a row takes, with the whole distribution it came from
        seen.setdefault((live.job.id, i), []).append((token, np.array(scores, copy=True)))
        take(live, i, token, scores)

    sched._take = spy
    jobs = []
    for ps, m, n, sampling in traffic:
        ids = [gen.tokenizer.encode(PROMPTS[p]) for p in ps]
        j = Job([PROMPTS[p] for p in ps], [len(i) for i in ids], n, m, Sampling(ignore_eos=True, **sampling), (),
                lambda e: None, gen.tokenizer, prompt_ids=ids)  # fmt: skip
        jobs.append(j)
    for j in jobs:
        sched.submit(j)
    sched.start()
    deadline = time.monotonic() + 60
    while not all(j.finished for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.002)
    serve.largest = sched.stats()["largest_batch"]
    sched.stop()
    assert all(j.finished for j in jobs)
    serve.path = type(sched.slots).__name__, sched.align  # which grouping the probe chose
    return {k: [seen[(j.id, i)] for i in range(len(j.rows))] for k, j in enumerate(jobs)}


def same(a: list, b: list) -> bool:
    """Rows with the same tokens and bit-identical distributions at every step."""
    return all(
        len(ra) == len(rb) and all(ta == tb and np.array_equal(la, lb) for (ta, la), (tb, lb) in zip(ra, rb))
        for ra, rb in zip(a, b)
    )


# the grouping the load-time probe picks on the tiny model (runtime/model/row_invariance.py): batched at left pads
# that are multiples of 8 where that is exact, each row alone where it is not (its int4 MatMulNBits computes
# one row differently from several; DynamicQuantizeMatMul scales a batch's activations together)
PATHS = {
    "fp32-concat": ("SlotLM", 8),
    "fp32-shared": ("SlotLM", 8),
    "int8-concat": ("SlotLM", 8),
    "int8dq-concat": ("SoloRows", None),
    "int8dq-shared": ("SoloRows", None),
    "int4-concat": ("SoloRows", None),
    "int4-shared": ("SoloRows", None),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_deterministic_rows_equal_each_request_alone(variants, name):
    gen = Generator(variants[name], spin=False)
    mixed = serve(gen, TRAFFIC, deterministic=True)
    assert serve.path == PATHS[name]
    assert serve.largest >= (3 if serve.path[1] else 1)  # aligned batching does batch the congruent rows
    for k, spec in enumerate(TRAFFIC):
        alone = serve(gen, [spec], deterministic=True)[0]
        assert same(mixed[k], alone), f"{name}: request {k} changed with the traffic"
    # and alone is the runtime's own: a greedy request's tokens and chosen log-probs are Generator.generate's
    (p,), m, _, _ = TRAFFIC[0]
    ref = gen.generate(PROMPTS[p], max_new_tokens=m, temperature=0, ignore_eos=True, logprobs=0)
    assert [t for t, _ in mixed[0][0]] == ref.token_ids
    assert [float(lp[0, t]) for t, lp in mixed[0][0]] == [e.logprob for e in ref.logprobs]


def test_the_default_batch_is_not_row_independent(variants):
    """The check above can fail: DynamicQuantizeMatMul's batch-wide activation scale moves every batched row."""
    gen = Generator(variants["int8dq-concat"], spin=False)
    mixed = serve(gen, TRAFFIC, deterministic=False)
    alone = serve(gen, [TRAFFIC[0]], deterministic=False)[0]
    assert not same(mixed[0], alone)


def test_generator_deterministic_runs_each_prompt_alone(variants):
    """Generator(deterministic=True): a list of prompts gives each prompt's own result (seeded too), and the
    callback sees the batch's row order."""
    folder = variants["int4-shared"]
    gen, det = Generator(folder), Generator(folder, deterministic=True)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.0, seed=3, ignore_eos=True, logprobs=0)
    alone = [gen.generate(p, **kw) for p in PROMPTS[:3]]
    steps = []
    got = det.generate(PROMPTS[:3], callback=steps.append, **kw)
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert [[e.logprob for e in r.logprobs] for r in got] == [[e.logprob for e in r.logprobs] for r in alone]
    assert all(len(s.tokens) == 3 and s.active.sum() == 1 for s in steps)
    assert [int(s.tokens[1]) for s in steps if s.active[1]] == alone[1].token_ids


def test_next_batch_deterministic_takes_one_request_per_batch(tiny_export):
    gen = Generator(tiny_export)
    jobs = deque(Job([p], [1], 1, 4, Sampling(temperature=0), (), lambda e: None, gen.tokenizer) for p in PROMPTS)
    assert len(take_batch(deque(jobs), 8, 1024)) == len(PROMPTS)  # greedy jobs share a batch by default
    assert len(take_batch(jobs, 8, 1024, alone=True)) == 1


def test_http_requests_with_logprobs_equal_their_runs_alone(variants):
    """Through the server (`serve --deterministic`): concurrent completions with logprobs, greedy and seeded, get
    the tokens and log-probs each gets alone (the int4 folder whose rows run alone; fp32 batches at aligned pads)."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from concurrent.futures import ThreadPoolExecutor

    from gpt2edge.serve.api.app import create_app
    from gpt2edge.serve.hosting.server import BackgroundServer
    from gpt2edge.serve.scheduling.continuous import make_scheduler

    bodies = [dict(prompt=PROMPTS[i], max_tokens=8 + i, logprobs=2, temperature=0 if i % 2 else 1.0, seed=i)
              for i in range(len(PROMPTS))]  # fmt: skip
    for name in ("int4-shared", "fp32-concat"):
        config = ServeConfig(model_name="t", max_batch=8, deterministic=True)
        gen = Generator(variants[name], spin=False)
        sched = make_scheduler(gen, config)
        with BackgroundServer(create_app(lambda s=sched: s, config)) as url:

            def post(body):
                r = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                c = r.json()["choices"][0]
                return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]

            alone = [post(b) for b in bodies]
            with ThreadPoolExecutor(len(bodies)) as pool:
                together = list(pool.map(post, bodies))
        assert together == alone, name


def test_a_request_of_unaligned_prompts_is_not_starved_by_steady_traffic():
    """A request whose prompts differ in length mod the alignment joins only an empty cache; younger aligned
    requests must not keep the cache from ever emptying (they wait behind it)."""
    from types import SimpleNamespace as NS

    from gpt2edge.serve.scheduling.grouping import take_aligned

    def job(lens, name):
        return NS(rows=[NS(prompt_len=n) for n in lens], name=name)

    slots = NS(live=3, past_len=20, free_rows=1)
    waiting, joined = deque(), {}
    for step in range(400):
        if step == 5:
            waiting.append(job([10, 13], "unaligned"))  # residues 2 and 5 mod 8
        if step % 3 == 0:
            waiting.append(job([8 + step % 8], f"s{step}"))  # a request every third step
        if slots.live and step % 3 == 1:
            slots.live -= 1  # and one leaves every third step
        slots.free_rows = 4 - slots.live
        jobs, isolated = take_aligned(waiting, slots, 256, 8)
        for j in jobs:
            if slots.live == 0:
                slots.past_len = max(r.prompt_len for r in j.rows)
            slots.live += len(j.rows)
            joined[j.name] = step
        slots.free_rows = 4 - slots.live
        slots.past_len += 1
        if isolated:  # the scheduler admits nobody else until its rows have left
            while slots.live:
                slots.live -= 1
                step += 1
    assert "unaligned" in joined and joined["unaligned"] < 40, joined.get("unaligned")
