"""Continuous batching (gpt2edge.serve.scheduling.continuous): requests join a running batch at a step boundary and
leave it when they end; every greedy row still gets its tokens alone (both graph kinds), a seeded request its text
whoever else is served. A --static folder is served within its batch and capacity (next-batch scheduler)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")

from gpt2edge.budget.memory import SHARE  # noqa: E402
from gpt2edge.errors import ServeError  # noqa: E402
from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.runtime.decoding.row_decoder import RowGroup  # noqa: E402
from gpt2edge.runtime.model.memory_plan import generation_estimate  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.api.app import create_app  # noqa: E402
from gpt2edge.serve.hosting.server import BackgroundServer  # noqa: E402
from gpt2edge.serve.scheduling.continuous import (  # noqa: E402
    ContinuousScheduler,
    load_scheduler,
    make_scheduler,
)
from gpt2edge.serve.scheduling.jobs import Job, Piece, Sampling  # noqa: E402
from gpt2edge.serve.scheduling.rows import MEMORY, STATIC, serving_rows  # noqa: E402
from gpt2edge.serve.scheduling.scheduler import Scheduler  # noqa: E402
from tests.support.serve import PROMPTS, alone, joined, post, stream_one  # noqa: E402

SAMPLED = dict(temperature=1.5, top_p=0.9)


def job(gen: Generator, prompt: str, max_tokens: int, out: list, n: int = 1, stop=(), **sampling) -> Job:
    return Job([prompt], [len(gen.tokenizer.encode(prompt)) or 1], n, max_tokens, Sampling(**sampling),
               tuple(stop), out.append, gen.tokenizer)  # fmt: skip


def texts(events: list, n: int = 1) -> list[str]:
    out = [""] * n
    for e in events:
        assert isinstance(e, Piece), e
        out[e.choice] += e.text
    return out


def wait(jobs, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(j.finished for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(j.finished for j in jobs)


@pytest.mark.parametrize("kind", ["tiny_export", "tiny_export_shared"])
def test_requests_joining_a_running_batch_get_their_tokens_alone(kind, request):
    """Three cache rows; requests arrive while others decode, wait for a free row, join mid-batch and leave
    at their own length, stop string or end of text."""
    gen = Generator(request.getfixturevalue(kind))
    scheduler = ContinuousScheduler(gen, ServeConfig(model_name="tiny", max_batch=3))
    scheduler.start()
    specs = [(p, 6 + 7 * (i % 4), ("e t",) if i % 3 == 0 else ()) for i, p in enumerate(PROMPTS)]
    events: list[list] = [[] for _ in specs]
    jobs = []
    for i, (p, m, stop) in enumerate(specs):
        jobs.append(job(gen, p, m, events[i], stop=stop, temperature=0))
        scheduler.submit(jobs[-1])
        steps = scheduler.stats()["steps"]
        while i % 2 and scheduler.stats()["steps"] < steps + 2 and not all(j.finished for j in jobs):
            time.sleep(0.002)  # every other request arrives a couple of steps into the running batch
    n_events: list = []
    n_job = job(gen, PROMPTS[1], 9, n_events, n=2, temperature=0)  # two rows joining together
    scheduler.submit(n_job)
    wait([*jobs, n_job])
    stats = scheduler.stats()
    scheduler.stop()
    for i, (p, m, stop) in enumerate(specs):
        assert texts(events[i]) == [alone(gen, p, m, stop)], f"request {i} ({kind})"
    assert texts(n_events, 2) == [alone(gen, PROMPTS[1], 9)] * 2
    assert stats["largest_batch"] == 3 and stats["running"] == 0
    assert stats["batches"] > 2  # newcomers joined in several groups: not one batch after another
    assert scheduler.slots.live == 0 and scheduler.slots.allocations <= 2


def test_seeded_requests_reproduce_whoever_else_is_served(tiny_export):
    """A seeded request (n=2) gives the runtime's sampled text for that seed, alone or among other traffic."""
    gen = Generator(tiny_export)
    prompt, m, seed = PROMPTS[0], 20, 1234
    kw = dict(do_sample=True, top_k=0, folder_defaults=False, ignore_eos=True, **SAMPLED)
    want = [r.text for r in gen.generate([prompt, prompt], max_new_tokens=m, seed=seed, **kw)]
    results = []
    for traffic in (0, 5):
        scheduler = ContinuousScheduler(gen, ServeConfig(model_name="tiny", max_batch=8))
        others = [job(gen, p, 12, [], ignore_eos=True, **SAMPLED) for p in PROMPTS[:traffic]]
        for j in others[:2]:
            scheduler.submit(j)
        scheduler.start()
        time.sleep(0.02)
        events: list = []
        seeded = job(gen, prompt, m, events, n=2, seed=seed, ignore_eos=True, **SAMPLED)
        scheduler.submit(seeded)
        for j in others[2:]:
            scheduler.submit(j)
        wait([seeded, *others])
        scheduler.stop()
        results.append(texts(events, 2))
    assert results[0] == results[1] == want


def test_a_client_that_leaves_frees_its_row_for_a_waiting_request(tiny_export):
    """One cache row: a long stream is abandoned, the waiting request takes the freed row at once."""
    gen = Generator(tiny_export)
    scheduler = ContinuousScheduler(gen, ServeConfig(model_name="tiny", max_batch=1))
    scheduler.start()
    long, short = [], []
    a = job(gen, "A", 120, long, ignore_eos=True, temperature=0)
    b = job(gen, PROMPTS[0], 5, short, temperature=0)
    scheduler.submit(a)
    scheduler.submit(b)
    while not long:
        time.sleep(0.002)
    a.cancel()
    wait([b])
    stats = scheduler.stats()
    scheduler.stop()
    assert texts(short) == [alone(gen, PROMPTS[0], 5)]
    assert stats["dropped_rows"] == 1 and len(long) < 100


def test_rows_just_freed_wait_briefly_for_their_clients_to_return(tiny_export):
    """A closed-loop client resends just after its stream ends: admission waits for it (bounded by a share of
    the last cycle), so it joins this step's group instead of leaving its row empty for a whole cycle."""
    gen = Generator(tiny_export)
    scheduler = ContinuousScheduler(gen, ServeConfig(model_name="tiny", max_batch=4))  # thread not started
    first, late = job(gen, "A", 2, []), job(gen, "B", 2, [])
    scheduler.submit(first)
    scheduler._freed, scheduler._cycle_s = 2, 20.0  # two rows just freed; a long cycle: a 1 s window
    threading.Timer(0.05, scheduler.submit, [late]).start()
    assert scheduler._admit() == [first, late]  # without the window: [first], and `late` a cycle later
    alone_job = job(gen, "C", 2, [])
    scheduler.submit(alone_job)
    scheduler._freed, scheduler._cycle_s = 3, 0.2  # nobody comes back: the wait ends after 5 % of 0.2 s
    t0 = time.monotonic()
    assert scheduler._admit() == [alone_job] and time.monotonic() - t0 < 5
    assert scheduler._freed == 0  # one window per release


def test_the_cache_rows_are_reserved_at_start(tiny_export):
    gen = Generator(tiny_export)
    scheduler = ContinuousScheduler(gen, ServeConfig(model_name="tiny", max_batch=3))
    slots = scheduler.slots
    assert slots.allocations == 1 and slots.capacity == min(128, slots.n_positions) and slots.live == 0
    assert slots.nbytes(slots.capacity) == slots._storage.nbytes  # every row, not only the first request's


def _plain_greedy(params, step: int) -> bool:
    return RowGroup([], params, np.random.default_rng(0))._plain_greedy(step)


def test_plain_greedy_rows_skip_the_processors_only_when_none_applies(tiny_export):
    """The row decoder's fast path (one argmax, no processor) only where no processor would change a score."""
    gen = Generator(tiny_export)
    plain = gen.sampling_params(max_new_tokens=8, do_sample=False, folder_defaults=False)
    assert _plain_greedy(plain, 0)
    held = gen.sampling_params(max_new_tokens=8, do_sample=False, folder_defaults=False, min_new_tokens=3)
    assert not _plain_greedy(held, 2) and _plain_greedy(held, 3)  # end-of-text banned until min_tokens
    for kw in (dict(repetition_penalty=1.3), dict(do_sample=True, temperature=0.7), dict(presence_penalty=0.5),
               dict(logit_bias={3: 1.0}), dict(stop_token_ids=[4])):  # fmt: skip
        assert not _plain_greedy(gen.sampling_params(max_new_tokens=8, folder_defaults=False, **kw), 5)


def test_the_server_s_onnx_runtime_threads_do_not_spin(tiny_export):
    """Spinning intra-op threads take the cores the event loop needs between steps (benchmarks/README.md)."""
    scheduler = load_scheduler(tiny_export, ServeConfig(model_name="tiny"), threads=1)
    opts = scheduler.generator.graph.session.get_session_options()
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_default_rows_are_64_or_what_memory_holds(tiny_export, monkeypatch):
    """Unset --max-batch: 64 rows, fewer when their KV cache over the whole context would not fit; a value that
    would not fit is refused before the server takes a request, a static graph bounds it by its batch."""
    gen = Generator(tiny_export)
    per_row = generation_estimate(gen.folder, [[0]], int(gen.folder.n_positions)).total
    assert serving_rows(gen, None) == (64, "")  # the tiny model's 64 rows fit anywhere
    monkeypatch.setenv("GPT2EDGE_MAX_MEMORY", str(int(10.5 * per_row / SHARE)))
    assert serving_rows(gen, None) == (10, MEMORY) and serving_rows(gen, 10) == (10, "")
    with pytest.raises(ServeError, match="lower --max-batch to at most 10"):
        serving_rows(gen, 11)
    scheduler = ContinuousScheduler(gen, ServeConfig(model_name="t"))
    assert scheduler.max_rows == scheduler.slots.rows == 10 and scheduler.limits().rows_why == MEMORY


def test_the_old_scheduler_stays_selectable(tiny_export):
    gen = Generator(tiny_export)
    assert type(make_scheduler(gen, ServeConfig(model_name="t"))) is ContinuousScheduler
    assert type(make_scheduler(gen, ServeConfig(model_name="t", scheduler="next-batch"))) is Scheduler
    with pytest.raises(ServeError, match="--scheduler must be one of continuous, next-batch"):
        ServeConfig(model_name="t", scheduler="fifo")


# ---- a --static folder: its batch and capacity ----------------------------------------------------------------


@pytest.fixture(scope="module")
def static_export(tiny_checkpoint, tmp_path_factory):
    from click.testing import CliRunner

    from gpt2edge.cli import main

    out = tmp_path_factory.mktemp("static") / "tiny-static"
    r = CliRunner().invoke(main, ["export", "-m", str(tiny_checkpoint), str(out), "--static", "2x8x64"])
    assert r.exit_code == 0, r.output
    return out


def test_a_static_folder_is_served_within_its_batch_and_capacity(static_export):
    gen = Generator(static_export)
    config = ServeConfig(model_name="tiny", max_batch=16)
    scheduler = make_scheduler(gen, config)
    assert type(scheduler) is Scheduler and scheduler.max_rows == 2 and scheduler.n_positions == 64
    assert serving_rows(gen, None) == (2, STATIC) and serving_rows(gen, 1) == (1, "")

    async def clients(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in PROMPTS[:6]]
            return await asyncio.gather(*(stream_one(client, b) for b in bodies))

    with BackgroundServer(create_app(lambda: scheduler, config)) as url:
        results = asyncio.run(clients(url))  # 6 concurrent clients: batches of at most 2 rows, all answered
        too_many = post(url, {"prompt": "a", "n": 3, "max_tokens": 4})
        too_long = post(url, {"prompt": "a", "max_tokens": 64})
    for i, events in enumerate(results):
        assert joined(events)[0] == alone(gen, PROMPTS[i], 8), f"client {i}"
    assert too_many.status_code == 400 and "at most 2 per request (its static graph's batch)" in too_many.text
    assert too_long.status_code == 400 and "64 positions" in too_long.json()["error"]["message"]
