"""The prefix cache (gpt2edge.runtime.model.prefix_cache; the continuous scheduler's join): a request's longest
cached prefix is copied into its row and only the rest prefilled; its tokens equal those without the cache (fp32,
both graph kinds, greedy and seeded, several choices); cached_tokens and /metrics report it; the byte bound and
memory pressure evict; bad sizes are refused at start."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")

from click.testing import CliRunner  # noqa: E402

from gpt2edge.budget.memory import ENV  # noqa: E402
from gpt2edge.cli import main  # noqa: E402
from gpt2edge.errors import GenerationError, ServeError  # noqa: E402
from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.runtime.model.prefix_cache import BLOCK, PrefixCache  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.api.app import create_app  # noqa: E402
from gpt2edge.serve.hosting.server import BackgroundServer  # noqa: E402
from gpt2edge.serve.scheduling.continuous import ContinuousScheduler  # noqa: E402
from gpt2edge.serve.scheduling.jobs import Job, Sampling  # noqa: E402
from gpt2edge.serve.scheduling.rows import serving_rows  # noqa: E402

SYSTEM = "You are a careful assistant. Answer briefly, in plain words, and never repeat the question back. "
USERS = ["The river rose and", "Snow fell on the quiet hills", "A", "Children learned to swim"]


def kv(n: int, seed: int = 0) -> list[np.ndarray]:
    """Random (nh=2, n, hs=4) keys/values for 2 tensors."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, n, 4)).astype(np.float32) for _ in range(2)]


def test_the_longest_cached_prefix_in_whole_blocks_and_copies_not_views():
    cache = PrefixCache(1 << 20, 2, 2, 4, np.float32)
    ids, tensors = list(range(3 * BLOCK + 5)), kv(3 * BLOCK + 5)
    assert cache.insert(ids, tensors) == 3  # whole blocks only
    want = [t[:, : 2 * BLOCK].copy() for t in tensors]
    for t in tensors:
        t[...] = np.nan  # the caller's buffer is overwritten by its next step
    blocks = cache.lookup(ids[: 2 * BLOCK] + [999] * 10, limit=2 * BLOCK + 9)
    assert len(blocks) == 2
    for t in range(2):
        np.testing.assert_array_equal(np.concatenate([b[t] for b in blocks], axis=1), want[t])
    # at least the last prompt token is left to prefill: a prompt of exactly 2 blocks reuses one
    assert len(cache.lookup(ids[: 2 * BLOCK], limit=2 * BLOCK - 1)) == 1
    assert cache.lookup([7] * 40, limit=39) == []  # a different first block: nothing
    s = cache.snapshot()
    assert (s["lookups"], s["hits"], s["tokens_reused"], s["blocks"]) == (3, 2, 3 * BLOCK, 3)


def test_a_small_bound_evicts_the_least_recently_used_leaves():
    cache = PrefixCache(0, 2, 2, 4, np.float32)
    assert cache.insert(list(range(BLOCK)), kv(BLOCK)) == 0  # off: nothing held
    cache = PrefixCache(3 * PrefixCache(1, 2, 2, 4, np.float32).block_bytes, 2, 2, 4, np.float32)
    a = list(range(2 * BLOCK))
    b = a[:BLOCK] + [500 + i for i in range(BLOCK)]  # shares a's first block
    c = [900 + i for i in range(2 * BLOCK)]
    assert cache.insert(a, kv(2 * BLOCK)) == 2 and cache.insert(b, kv(2 * BLOCK)) == 1  # 3 blocks: full
    cache.lookup(b, 2 * BLOCK)  # b's path is now the most recent; a's second block is the oldest leaf
    assert cache.insert(c, kv(2 * BLOCK)) == 2  # evicts a's leaf, then b's leaf (never the shared parent first)
    s = cache.snapshot()
    assert s["evictions"] == 2 and s["bytes_held"] == 3 * cache.block_bytes <= cache.max_bytes
    assert len(cache.lookup(c, 2 * BLOCK)) == 2 and len(cache.lookup(a, 2 * BLOCK)) == 1
    assert len(cache.lookup(b, 2 * BLOCK)) == 1


def test_memory_pressure_evicts_instead_of_growing(monkeypatch):
    cache = PrefixCache(1 << 30, 2, 2, 4, np.float32)
    assert cache.insert(list(range(2 * BLOCK)), kv(2 * BLOCK)) == 2
    monkeypatch.setenv(ENV, str(4 * cache.block_bytes))  # one more block would take over a fifth of what is left
    assert cache.insert([900 + i for i in range(2 * BLOCK)], kv(2 * BLOCK)) == 0
    s = cache.snapshot()
    assert s["blocks"] == 0 and s["evictions"] == 2  # it gave way; nothing failed


# ---- the scheduler: with the cache equals without ------------------------------------------------------------


def _run(gen: Generator, cache_bytes: int, turns: list[tuple[str, dict]], n: int) -> tuple[list, dict]:
    """Each turn waits for the one before (a chat resending its history): per turn, the choices' token ids."""
    config = ServeConfig(model_name="tiny", max_batch=4, prefix_cache_bytes=cache_bytes)
    scheduler = ContinuousScheduler(gen, config)
    scheduler.start()
    out = []
    try:
        for prompt, sampling in turns:
            tokens = len(gen.tokenizer.encode(prompt))
            job = Job([prompt], [tokens], n, 8, Sampling(**sampling), (), lambda e: None, gen.tokenizer)
            scheduler.submit(job)
            deadline = time.monotonic() + 60
            while not job.finished and time.monotonic() < deadline:
                time.sleep(0.002)
            assert job.finished
            out.append(([list(r.decoder.generated) for r in job.rows], job.cached_tokens))
        return out, scheduler.stats()
    finally:
        scheduler.stop()


@pytest.mark.parametrize("kind", ["tiny_export", "tiny_export_shared"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.2, seed=7, ignore_eos=True)])
def test_outputs_with_the_cache_equal_outputs_without(kind, sampling, request):
    gen = Generator(request.getfixturevalue(kind))
    turns, history = [], SYSTEM
    for user in USERS[:2]:  # a chat: each turn resends the history with the model's earlier answer
        history += user
        turns.append((history, sampling))
        history += " and then"
    turns += [(SYSTEM + u, sampling) for u in USERS[2:]]  # other chats under the same system prompt
    plain, _ = _run(gen, 0, turns, n=2)
    cached, stats = _run(gen, 1 << 24, turns, n=2)
    assert [t for t, _ in cached] == [t for t, _ in plain]
    assert [c for _, c in plain] == [0] * len(turns)
    reused = [c for _, c in cached]
    assert reused[0] == 0 and all(c >= BLOCK and c % BLOCK == 0 for c in reused[1:])
    assert stats["prefix_hits"] >= 2 * (len(turns) - 1)  # every row of every later turn (n=2 rows each)
    assert stats["prefix_tokens_reused"] == 2 * sum(reused)  # cached_tokens counts a prompt once, not per choice


def test_admission_counts_only_the_tokens_a_join_prefills(tiny_export):
    """--prefill-tokens budgets what a join computes: a cached system prompt lets more newcomers join per step."""
    gen = Generator(tiny_export)
    scheduler = ContinuousScheduler(gen, ServeConfig(model_name="tiny", prefix_cache_bytes=1 << 24))
    ids = gen.tokenizer.encode(SYSTEM + USERS[0])
    job = Job([""], [len(ids)], 2, 4, Sampling(temperature=0), (), lambda e: None, gen.tokenizer, prompt_ids=[ids])
    assert scheduler._prefill_tokens(job) == 2 * len(ids)  # nothing cached yet: every row prefills it all
    scheduler.prefix.cache.insert(ids, _kv_of(gen, ids))
    assert scheduler._prefill_tokens(job) == 2 * (len(ids) - (len(ids) - 1) // BLOCK * BLOCK)
    assert scheduler.stats()["prefix_lookups"] == 0  # an estimate, not a lookup


def _kv_of(gen: Generator, ids: list[int]) -> list[np.ndarray]:
    """ids' keys and values, from one row's prefill."""
    from gpt2edge.runtime.model.slots import SlotLM

    slot = SlotLM(gen.graph, 1)
    slot.join([ids], gen.pad_token_id)
    return [t.copy() for t in slot.row_kv(0)]


# ---- the Python API: generate, stream, sessions --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tiny_export", "tiny_export_shared"])
@pytest.mark.parametrize("io_binding", [True, False])
def test_the_generator_s_cache_gives_the_same_tokens(kind, io_binding, request):
    folder = request.getfixturevalue(kind)
    plain = Generator(folder, io_binding=io_binding)
    cached = Generator(folder, io_binding=io_binding, prefix_cache_bytes=1 << 24)
    for kw in (dict(do_sample=False), dict(do_sample=True, seed=3, temperature=1.3)):
        for i, user in enumerate(USERS[:3]):
            a = plain.generate(SYSTEM + user, max_new_tokens=8, ignore_eos=True, **kw)
            b = cached.generate(SYSTEM + user, max_new_tokens=8, ignore_eos=True, **kw)
            assert b.token_ids == a.token_ids
            assert b.cached_tokens % BLOCK == 0 and (b.cached_tokens == 0) == (i == 0 and "seed" not in kw)
            follow = SYSTEM + user + a.text  # the next turn resends the answer: more of it is cached
            want = plain.generate(follow, max_new_tokens=5, ignore_eos=True, **kw).text
            assert "".join(cached.stream(follow, max_new_tokens=5, ignore_eos=True, **kw)) == want
    quiet = dict(on_overflow=lambda notice: None)  # the second turn passes 128 positions: the oldest drop
    turns = [plain.session(**quiet), cached.session(**quiet)]
    for text in ["Hello", " and more"]:
        r0, r1 = (t.generate(SYSTEM + text, max_new_tokens=6, ignore_eos=True) for t in turns)
        assert r1.token_ids == r0.token_ids
    fresh = cached.session()  # a new conversation under the same system prompt starts from the cache
    assert fresh.generate(SYSTEM + "Hello", max_new_tokens=6).cached_tokens == 3 * BLOCK
    assert fresh.last_prefill_tokens == len(cached.tokenizer.encode(SYSTEM + "Hello")) - 3 * BLOCK


def test_threads_share_the_generator_s_cache(tiny_export_shared):
    """Concurrent calls look up and add under the cache's lock; each still gets its tokens alone."""
    from concurrent.futures import ThreadPoolExecutor

    plain, cached = Generator(tiny_export_shared), Generator(tiny_export_shared, prefix_cache_bytes=1 << 24)
    prompts = [SYSTEM + u for u in USERS] * 2
    want = [plain.generate(p, max_new_tokens=6, do_sample=False).token_ids for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: cached.generate(p, max_new_tokens=6, do_sample=False).token_ids, prompts))
    assert got == want
    assert cached.prefix_cache.snapshot()["hits"] >= len(USERS)


def test_the_generator_refuses_a_bad_or_oversized_cache(tiny_export, monkeypatch):
    from gpt2edge.errors import GenerationError

    with pytest.raises(GenerationError, match="prefix_cache_bytes must be a whole number of bytes >= 0"):
        Generator(tiny_export, prefix_cache_bytes=-5)
    monkeypatch.setenv(ENV, "100M")
    with pytest.raises(GenerationError, match=r"prefix_cache_bytes would hold about 1\.1 GB .*prefix cache 1\.1 GB"):
        Generator(tiny_export, prefix_cache_bytes=1 << 30)


# ---- HTTP: usage, /metrics, refusals ----------------------------------------------------------------------------


def test_cached_tokens_and_metrics_over_http(tiny_export, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    config = ServeConfig(model_name="tiny", max_batch=4, prefix_cache_bytes=1 << 24, chat_template=str(template))
    scheduler = ContinuousScheduler(Generator(tiny_export), config)
    with BackgroundServer(create_app(lambda: scheduler, config)) as url:
        body = {"prompt": SYSTEM + USERS[0], "max_tokens": 3, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
        again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = again["prompt_tokens_details"]["cached_tokens"]
        assert BLOCK <= cached < again["prompt_tokens"] and cached % BLOCK == 0
        streamed = {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json={**body, **streamed}, timeout=60) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        chat = {"messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 2, "temperature": 0}
        httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        usage = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= BLOCK
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, **streamed}, timeout=60) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"] == usage["prompt_tokens_details"]
        metrics = httpx.get(url + "/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line[:1] != "#"}
    assert values["gpt2edge_prefix_cache_lookups_total"] == 6
    assert values["gpt2edge_prefix_cache_hits_total"] == 4
    assert values["gpt2edge_prefix_cache_tokens_reused_total"] >= 4 * BLOCK
    assert values["gpt2edge_prefix_cache_evictions_total"] == 0
    assert values["gpt2edge_prefix_cache_bytes"] > 0


def test_a_prefix_cache_beyond_the_machine_is_refused_at_start(tiny_export, monkeypatch):
    gen = Generator(tiny_export)
    monkeypatch.setenv(ENV, "100M")
    with pytest.raises(ServeError, match=r"--prefix-cache-bytes: a prefix cache of 1\.1 GB is more than"):
        serving_rows(gen, None, 1 << 30)
    rows, _ = serving_rows(gen, None, 70 << 20)  # fits, and the rows get what it leaves
    assert rows < serving_rows(gen, None)[0]
    with pytest.raises(ServeError, match="--prefix-cache-bytes must be >= 0"):
        ServeConfig(model_name="tiny", prefix_cache_bytes=-1)
    result = CliRunner().invoke(main, ["serve", str(tiny_export), "--prefix-cache-bytes", "lots"])
    assert result.exit_code == 2 and "is not a size" in result.output


def test_deterministic_refuses_a_prefix_cache(tiny_export):
    """A cached prefix was computed beside other rows, at another pad: --deterministic cannot promise its bits."""
    with pytest.raises(ServeError, match="--deterministic and --prefix-cache-bytes cannot be combined"):
        ServeConfig(model_name="tiny", deterministic=True, prefix_cache_bytes=1 << 20)
    ServeConfig(model_name="tiny", deterministic=True)  # either alone is fine
    with pytest.raises(GenerationError, match="deterministic=True and prefix_cache_bytes cannot be combined"):
        Generator(tiny_export, deterministic=True, prefix_cache_bytes=1 << 20)
    result = CliRunner().invoke(main, ["serve", str(tiny_export), "--deterministic", "--prefix-cache-bytes", "1M"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "combined" in lines[0]


def test_the_next_batch_scheduler_takes_no_memory_for_a_prefix_cache(tiny_export, caplog):
    """Only the continuous scheduler reuses prefixes: elsewhere the flag is said to be ignored and costs no rows."""
    from gpt2edge.serve.scheduling.continuous import make_scheduler

    gen = Generator(tiny_export, threads=1)
    config = ServeConfig(model_name="tiny", scheduler="next-batch", prefix_cache_bytes=1 << 24)
    with caplog.at_level("WARNING", logger="gpt2edge.serve"):
        scheduler = make_scheduler(gen, config)
    assert scheduler.config.prefix_cache_bytes == 0 and "--prefix-cache-bytes is ignored" in caplog.text
    assert scheduler.max_rows == serving_rows(gen, None)[0]  # not shrunk for a cache it does not keep
