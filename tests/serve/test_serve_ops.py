"""Operators' endpoints (/metrics parsed as Prometheus text, /tokenize, /detokenize, /health while loading,
request ids, the access log, --api-key) and what clients send beside OpenAI's basics (vLLM's / llama-server's
sampling fields, penalties, logit_bias, stop_token_ids, chat completions rendered as transformers renders)."""

from __future__ import annotations

import json
import logging
import shutil
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")
parser = pytest.importorskip("prometheus_client.parser", reason="prometheus-client is not installed (serve extra)")

from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.runtime.decoding.row_penalties import RowPenalties  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.api.app import create_app  # noqa: E402
from gpt2edge.serve.hosting.server import BackgroundServer  # noqa: E402
from gpt2edge.serve.scheduling.continuous import ContinuousScheduler  # noqa: E402
from gpt2edge.serve.scheduling.jobs import Sampling  # noqa: E402
from tests.support.serve import GREEDY, PROMPTS, alone, parse_sse, post, running, wait_ready  # noqa: E402


@pytest.fixture(scope="module")
def gen(tiny_export) -> Generator:
    return Generator(tiny_export)


def metric(text: str, name: str, **labels) -> float:
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_metrics_count_requests_tokens_and_latencies(tiny_export):
    with running(tiny_export, max_batch=4) as (url, _):
        bodies = [{"prompt": p, "max_tokens": 5 + i, "ignore_eos": True, "temperature": 0} for i, p in
                  enumerate(PROMPTS[:3])]  # fmt: skip
        for b in bodies:
            assert post(url, b).status_code == 200
        assert post(url, {"prompt": "a", "max_tokens": 0}).status_code == 400
        text = httpx.get(url + "/metrics").text
    assert metric(text, "gpt2edge_requests_total", path="/v1/completions", status="200") == 3
    assert metric(text, "gpt2edge_requests_total", path="/v1/completions", status="400") == 1
    assert metric(text, "gpt2edge_generation_tokens_total") == 5 + 6 + 7
    assert metric(text, "gpt2edge_time_to_first_token_seconds_count") == 3
    assert metric(text, "gpt2edge_inter_token_latency_seconds_count") == 4 + 5 + 6
    assert metric(text, "gpt2edge_requests_waiting") == 0 and metric(text, "gpt2edge_rows_running") == 0
    assert metric(text, "gpt2edge_prompt_tokens_total") > 0


def test_tokenize_and_detokenize_round_trip(tiny_export, gen):
    with running(tiny_export) as (url, _):
        tok = httpx.post(url + "/tokenize", json={"prompt": PROMPTS[7]}).json()
        assert tok["tokens"] == gen.tokenizer.encode(PROMPTS[7]) and tok["count"] == len(tok["tokens"])
        assert tok["max_model_len"] == 128
        assert httpx.post(url + "/tokenize", json={"content": "a b"}).json()["tokens"] == gen.tokenizer.encode("a b")
        back = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()
        assert back["prompt"] == PROMPTS[7] == back["content"]
        bad = httpx.post(url + "/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
        assert httpx.post(url + "/tokenize", json={"prompt": "a", "content": "b"}).status_code == 400
        assert httpx.post(url + "/tokenize", content=b'{"prompt": "a", "prompt": "b"}').status_code == 400


def test_health_says_loading_until_the_model_is_ready(tiny_export):
    release = threading.Event()
    config = ServeConfig(model_name="tiny")

    def slow_load():
        release.wait(30)
        return ContinuousScheduler(Generator(tiny_export), config)

    with BackgroundServer(create_app(slow_load, config, background=True)) as url:
        health = httpx.get(url + "/health")
        assert (health.status_code, health.json()["status"]) == (503, "loading")
        r = post(url, {"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
        release.set()
        wait_ready(url)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert post(url, {"prompt": "a", "max_tokens": 2}).status_code == 200


def test_request_ids_and_the_access_log(tiny_export, caplog):
    caplog.set_level(logging.INFO, logger="gpt2edge.access")
    with running(tiny_export) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 3}, headers={"x-request-id": "r-1"})
        generated = httpx.get(url + "/health").headers["x-request-id"]
        too_long = httpx.get(url + "/health", headers={"x-request-id": "a" * 65}).headers["x-request-id"]
        spaced = httpx.get(url + "/health", headers={"x-request-id": "a b"}).headers["x-request-id"]
    assert r.headers["x-request-id"] == "r-1" and len(generated) == 32
    assert too_long != "a" * 65 and spaced != "a b"  # not echoed into logs: replaced by a fresh id
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "gpt2edge.access"]
    line = next(x for x in lines if x["request_id"] == "r-1")
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/completions", 200)
    assert line["completion_tokens"] == 3 and line["rows"] == 1 and line["duration_ms"] > 0 and "ttft_ms" in line


def test_api_key(tiny_export, caplog):
    caplog.set_level(logging.INFO)
    with running(tiny_export, api_key="s3cret-key") as (url, _):
        body = {"prompt": "a", "max_tokens": 2}
        missing = httpx.post(url + "/v1/completions", json=body)
        wrong = httpx.post(url + "/v1/completions", json=body, headers={"authorization": "Bearer nope"})
        right = httpx.post(url + "/v1/completions", json=body, headers={"authorization": "Bearer s3cret-key"})
        assert httpx.get(url + "/health").status_code == 200  # probes need no key
        assert httpx.post(url + "/tokenize", json={"prompt": "a"}).status_code == 401
    assert missing.status_code == wrong.status_code == 401 and right.status_code == 200
    assert missing.headers["www-authenticate"] == "Bearer" and missing.json()["error"]["code"] == "invalid_api_key"
    assert "s3cret-key" not in caplog.text


# ---- sampling fields ------------------------------------------------------------------------------------------


def test_vllm_sampling_fields_match_the_runtime(tiny_export, gen):
    fields = dict(temperature=0.8, top_k=5, min_p=0.05, typical_p=0.9, repetition_penalty=1.3, seed=7)
    want = gen.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True, min_new_tokens=3, do_sample=True,
                        folder_defaults=False, **fields).text  # fmt: skip
    greedy = gen.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True, repetition_penalty=1.3, top_k=0,
                          do_sample=False, folder_defaults=False).text  # fmt: skip
    with running(tiny_export) as (url, _):
        body = {"prompt": PROMPTS[0], "max_tokens": 20, "ignore_eos": True, "min_tokens": 3, **fields}
        assert post(url, body).json()["choices"][0]["text"] == want
        body = {"prompt": PROMPTS[0], "max_tokens": 20, "ignore_eos": True, "temperature": 0,
                "repetition_penalty": 1.3, "top_k": -1}  # fmt: skip
        assert post(url, body).json()["choices"][0]["text"] == greedy


def test_logit_bias_stop_token_ids_and_penalties(tiny_export, gen):
    ids = gen.generate(PROMPTS[3], max_new_tokens=12, ignore_eos=True, **GREEDY).token_ids
    k = next(i for i in range(1, 12) if ids[i] not in ids[:i])  # a token first generated at step k
    forced = ids[0] + 1
    with running(tiny_export) as (url, _):
        base = {"prompt": PROMPTS[3], "max_tokens": 12, "ignore_eos": True, "temperature": 0}
        stopped = post(url, {**base, "stop_token_ids": [ids[k]]}).json()["choices"][0]
        assert stopped == {**stopped, "text": gen.tokenizer.decode(ids[:k]), "finish_reason": "stop"}
        held = post(url, {**base, "stop_token_ids": [ids[k]], "min_tokens": 12}).json()["choices"][0]
        assert held["finish_reason"] == "length"  # min_tokens holds stop_token_ids back as it holds EOS
        bias = post(url, {**base, "max_tokens": 4, "logit_bias": {str(forced): 100}}).json()["choices"][0]["text"]
        assert bias == gen.tokenizer.decode([forced] * 4)
        banned = post(url, {**base, "logprobs": 1, "logit_bias": {str(ids[0]): -100}}).json()["choices"][0]
        assert banned["logprobs"]["tokens"][0] != gen.tokenizer.decode([ids[0]])
        assert banned["logprobs"]["token_logprobs"][0] < 0  # log-probs are the model's, before the bias
        plain = post(url, base).json()["choices"][0]["text"]
        assert post(url, {**base, "frequency_penalty": 2}).json()["choices"][0]["text"] != plain


def test_penalties_follow_openais_formula():
    s = Sampling(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((1, 3.0),), stop_token_ids=(4,),
                 min_tokens=2)  # fmt: skip
    kw = dict(presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logit_bias=s.logit_bias,
              stop_token_ids=s.stop_token_ids, min_tokens=s.min_tokens)  # fmt: skip
    p = RowPenalties(6, None, **kw)
    for t in (2, 2, 3):
        p.push(t)
    scores = np.zeros((1, 6), np.float32)
    out = p.apply(scores, n_generated=1)
    assert out.tolist() == [[0, 3, -0.5 - 0.5, -0.5 - 0.25, -np.inf, 0]]
    assert p.apply(scores, n_generated=2)[0, 4] == 0 and scores.tolist() == [[0] * 6]


# ---- chat completions -----------------------------------------------------------------------------------------

TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% else %}{{ message['role'] | upper }}: {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the river?"},
            {"role": "assistant", "content": "North."}, {"role": "user", "content": "And the hills?"}]  # fmt: skip


@pytest.fixture(scope="module")
def chat_folder(tiny_export, tmp_path_factory):
    out = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_export, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


def test_chat_completions_render_the_template_as_transformers_does(chat_folder, gen):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(chat_folder / "tokenizer.json"), eos_token="<|endoftext|>")
    hf.chat_template = TEMPLATE
    prompt = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want = alone(gen, prompt, 10, ignore_eos=True)
    with running(chat_folder) as (url, _):
        body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/chat/completions", json=body).json()
        assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant", "content": want}
        assert r["usage"]["prompt_tokens"] == len(gen.tokenizer.encode(prompt))
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as s:
            events = parse_sse(list(s.iter_lines()))
        assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == want
        assert events[0]["object"] == "chat.completion.chunk" and events[-1] == "[DONE]"
        lp = httpx.post(url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2}).json()
        content = lp["choices"][0]["logprobs"]["content"]
        assert bytes(b for c in content for b in c["bytes"]).decode(errors="replace") == want
        assert all(len(c["top_logprobs"]) == 2 for c in content)


def test_chat_without_a_template_is_a_clear_400(tiny_export):
    with running(tiny_export) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES})
        bad_role = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
    assert "--chat-template" in r.json()["error"]["message"]
    assert bad_role.status_code == 400

