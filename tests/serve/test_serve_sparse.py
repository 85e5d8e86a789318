"""A sparse-head folder served with continuous batching: the body graph under the cache rows, its log-probs from
the full head (gpt2edge.runtime.sparse_head.body.BodyGraph.slot_view), so concurrent greedy requests get the folder's
Generator text, and logit_bias / stop_token_ids / penalties are served. An approximate folder keeps next-batch,
with a log line saying why."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")

from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.runtime.model.slots import SlotLM  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.api.app import create_app  # noqa: E402
from gpt2edge.serve.hosting.server import BackgroundServer  # noqa: E402
from gpt2edge.serve.scheduling.continuous import ContinuousScheduler, make_scheduler  # noqa: E402
from gpt2edge.serve.scheduling.scheduler import Scheduler  # noqa: E402
from tests.support.serve import GREEDY, PROMPTS, alone, joined, post, stream_one  # noqa: E402


@pytest.fixture(scope="module", params=["tiny_export", "tiny_export_shared", "tail_shared"])
def sparse_folder(request, tmp_path_factory):
    """The tiny export (either cache kind, and a --head tail one: a speculative target's) with an exact sparse
    head (cheap: rank 4, 32 candidates)."""
    from gpt2edge.export import export_model
    from gpt2edge.sparse.handler import sparse_head

    root = tmp_path_factory.mktemp("sparse-serve")
    if request.param == "tail_shared":
        src = root / "tail-shared"
        ckpt = request.getfixturevalue("tiny_checkpoint")
        export_model(str(ckpt), src, kv_cache="shared", head="tail", run_validation=False, log=None)
    else:
        src = request.getfixturevalue(request.param)
    out = root / f"{request.param}-sparse"
    sparse_head(src, out, rank=4, candidates_k=32)
    return out


def test_a_sparse_folder_is_served_with_continuous_batching(sparse_folder, caplog):
    gen = Generator(sparse_folder)
    assert gen.graph.slot_refusal is None
    config = ServeConfig(model_name="tiny", max_batch=3)
    with caplog.at_level(logging.WARNING, logger="gpt2edge.serve"):
        scheduler = make_scheduler(gen, config)
    assert type(scheduler) is ContinuousScheduler and "next-batch" not in caplog.text
    ids = gen.generate(PROMPTS[3], max_new_tokens=10, ignore_eos=True, **GREEDY).token_ids
    k = next(i for i in range(1, 10) if ids[i] not in ids[:i])  # a token first generated at step k
    forced = ids[0] + 1

    async def clients(url):  # more clients than cache rows: some join a running batch
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in PROMPTS[:5]]
            return await asyncio.gather(*(stream_one(client, b) for b in bodies))

    with BackgroundServer(create_app(lambda: scheduler, config)) as url:
        results = asyncio.run(clients(url))
        base = {"prompt": PROMPTS[3], "max_tokens": 10, "ignore_eos": True, "temperature": 0}
        stopped = post(url, {**base, "stop_token_ids": [ids[k]]})
        bias = post(url, {**base, "max_tokens": 3, "logit_bias": {str(forced): 100}})
        plain = post(url, base)
        penalised = post(url, {**base, "frequency_penalty": 2, "presence_penalty": 1})
    for i, events in enumerate(results):
        assert joined(events)[0] == alone(gen, PROMPTS[i], 8), f"client {i}"
    assert stopped.status_code == 200, stopped.text
    choice = stopped.json()["choices"][0]
    assert choice["text"] == gen.tokenizer.decode(ids[:k]) and choice["finish_reason"] == "stop"
    assert bias.status_code == 200 and bias.json()["choices"][0]["text"] == gen.tokenizer.decode([forced] * 3)
    assert plain.json()["choices"][0]["text"] == gen.tokenizer.decode(ids)
    assert penalised.status_code == 200 and penalised.json()["choices"][0]["text"] != gen.tokenizer.decode(ids)


def test_the_body_s_own_head_and_head_onnx_give_the_same_rows(sparse_folder):
    """Both ways SlotLM reads a sparse folder's log-probs (the body graph's copy of the head, or head.onnx on
    `hidden` for folders without one) agree, and match the Generator's full-head log-probs."""
    graph = Generator(sparse_folder).graph
    in_graph, by_file = SlotLM(graph, 2), SlotLM(graph, 2)
    if graph.tail:  # a tail body holds no copy of the head: its rows come from head.onnx on `hidden`
        assert in_graph.output == "hidden" and in_graph.head == graph.full_head
    else:  # this build has the head in the body graph
        assert in_graph.output == "logprobs" and in_graph.head is None
    by_file.output, by_file.head = "hidden", graph.full_head
    by_file.switches = {n: np.array(n != "sparse_step") for n in by_file.switches}
    prompts = [[5, 17, 42], [3]]  # the tiny vocabulary has 400 tokens
    a, b = in_graph.join(prompts, 0), by_file.join(prompts, 0)
    np.testing.assert_allclose(a, b, atol=1e-5)
    tokens = np.argmax(a, axis=-1)
    np.testing.assert_allclose(in_graph.step(tokens), by_file.step(tokens), atol=1e-5)


def test_an_approximate_folder_logs_why_it_runs_next_batch(tiny_export, tmp_path, caplog):
    from gpt2edge.sparse.approx_handler import cluster_sparse_head

    cluster_sparse_head(tiny_export, tmp_path / "approx", clusters=16, probe=4, report=False, log=None)
    gen = Generator(tmp_path / "approx")
    with caplog.at_level(logging.WARNING, logger="gpt2edge.serve"):
        scheduler = make_scheduler(gen, ServeConfig(model_name="tiny"))
    assert type(scheduler) is Scheduler
    assert "continuous batching is off: an approximate sparse head (--mode cluster)" in caplog.text
    assert "dynamic export" not in caplog.text
