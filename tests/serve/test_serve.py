"""`gpt2edge serve`: the real server (uvicorn on 127.0.0.1, a free port) driven by real HTTP clients (httpx).

Batching must not change a greedy row's tokens; bad input gets an OpenAI-shaped 4xx and the server stays up;
clients that leave free their rows; nothing is retained after a storm of half-abandoned streams.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import shutil
import signal
import sys
import time
from collections import deque
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")

from gpt2edge.manifest import load_manifest, write_manifest  # noqa: E402
from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.runtime.decoding.logprobs import LogprobRecorder, TokenLogprob  # noqa: E402
from gpt2edge.runtime.decoding.row_decoder import RowDecoder  # noqa: E402
from gpt2edge.runtime.decoding.sampling_params import SamplingParams  # noqa: E402
from gpt2edge.runtime.model.tokenizer import TextStream, TextTokenizer  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.scheduling.batch import advance, take_batch  # noqa: E402
from gpt2edge.serve.scheduling.jobs import Job, Piece, Sampling  # noqa: E402
from gpt2edge.serve.scheduling.scheduler import Scheduler  # noqa: E402
from tests.support import python_child  # noqa: E402
from tests.support.serve import (  # noqa: E402
    GREEDY,
    PROMPTS,
    alone,
    joined,
    parse_sse,
    post,
    running,
    stream_one,
    wait_idle,
)


@pytest.fixture(scope="module")
def ref(tiny_export) -> Generator:
    return Generator(tiny_export)


@pytest.fixture(scope="module")
def server(tiny_export):
    with running(tiny_export, max_batch=8, batch_wait_ms=50) as (url, _):
        yield url


# ---- what a completion returns --------------------------------------------------------------------------


def test_completion_equals_generating_alone(server, ref):
    prompts = PROMPTS[:3]
    r = post(server, {"model": "tiny", "prompt": prompts, "max_tokens": 12, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for c in body["choices"]:
        assert c["text"] == alone(ref, prompts[c["index"] // 2], 12)
        assert c["finish_reason"] in ("stop", "length") and c["logprobs"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(len(ref.tokenizer.encode(p)) for p in prompts)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= 6 * 12


def test_a_folder_asking_for_beams_and_bans_is_served_with_openai_semantics(tiny_export, ref, tmp_path):
    """generation_config.json may ask for beam search, n-gram bans, typical-p: the server answers OpenAI's
    request (one greedy sequence per choice), as the runtime does when told so, and streams as usual."""
    folder = tmp_path / "beams"
    shutil.copytree(tiny_export, folder)
    path = folder / "generation_config.json"
    extra = dict(num_beams=4, num_return_sequences=2, no_repeat_ngram_size=2, typical_p=0.5, bad_words_ids=[[11]])
    path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    write_manifest(folder, dict(load_manifest(folder).raw))
    with running(folder, max_batch=8, batch_wait_ms=10) as (url, _):
        r = post(url, {"prompt": PROMPTS[:2], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        events = asyncio.run(_stream(url, {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, "stream": True}))  # fmt: skip
    assert texts == [alone(ref, p, 12, ignore_eos=True) for p in PROMPTS[:2]]
    assert events[-1] == "[DONE]" and joined(events)[0] == texts[0]  # joined() skips the last event


def test_stream_is_sse_and_joins_to_the_plain_text(server, ref):
    body = {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=dict(body, stream=True,
                      stream_options={"include_usage": True}), timeout=60) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 20
    assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-3])
    plain = post(server, body).json()["choices"][0]["text"]
    assert joined(events[:-1])[0] == plain == alone(ref, PROMPTS[1], 20, (), True)


def test_stop_strings_cut_like_the_runtime(server, ref):
    full = alone(ref, PROMPTS[3], 40, ignore_eos=True)
    stop = full[12:15]  # a string that certainly occurs; the text must end right before its first occurrence
    body = {"prompt": PROMPTS[3], "max_tokens": 40, "temperature": 0, "stop": [stop, "\u2603never"], "ignore_eos": True}
    plain = post(server, body).json()["choices"][0]
    assert plain["finish_reason"] == "stop"
    assert plain["text"] == full[: full.find(stop)] == alone(ref, PROMPTS[3], 40, [stop, "\u2603never"], True)
    events = asyncio.run(_stream(server, body))
    assert joined(events)[0] == plain["text"]


async def _stream(url, body, **kw):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await stream_one(client, body, **kw)


def test_echo_and_seeded_sampling(server):
    body = {"prompt": "The city", "max_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 3, "echo": True}
    a, b = post(server, body).json(), post(server, body).json()
    assert a["choices"][0]["text"].startswith("The city")
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # a seeded request runs alone: reproducible


def test_models_and_health(server):
    models = httpx.get(server + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 128
    assert httpx.get(server + "/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(server + "/health").json()["status"] == "ok"


# ---- batching -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tiny_export", "tiny_export_shared"])
def test_a_batch_gives_every_row_its_tokens_alone(kind, request):
    """Jobs queued before the scheduler starts form one left-padded batch; each row equals its run alone."""
    folder = request.getfixturevalue(kind)
    gen = Generator(folder)
    config = ServeConfig(model_name="tiny", max_batch=16)
    scheduler = Scheduler(gen, config)
    got: dict[int, list] = {}
    specs = [(p, 8 + 5 * i, ("e t",) if i % 3 == 0 else ()) for i, p in enumerate(PROMPTS)]
    jobs = [
        Job([p], [len(gen.tokenizer.encode(p)) or 1], 1, m, Sampling(temperature=0), stop,
            got.setdefault(i, []).append, gen.tokenizer)
        for i, (p, m, stop) in enumerate(specs)
    ]  # fmt: skip
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    deadline = time.monotonic() + 60
    while not all(j.finished for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.stop()
    assert scheduler.stats()["batches"] == 1 and scheduler.stats()["largest_batch"] == len(PROMPTS)
    reference = Generator(folder)
    for i, (p, m, stop) in enumerate(specs):
        assert all(isinstance(e, Piece) for e in got[i])
        assert "".join(e.text for e in got[i]) == alone(reference, p, m, stop), f"row {i} ({kind})"


def test_a_batch_waits_for_a_burst_that_is_still_arriving(tiny_export):
    """Requests that arrive in quick succession start together, even though the first found the server idle."""
    gen = Generator(tiny_export)
    scheduler = Scheduler(gen, ServeConfig(model_name="tiny", batch_wait_ms=1000))  # quiet gap 0.1 s
    scheduler.start()
    jobs = [Job([p], [len(gen.tokenizer.encode(p))], 1, 4, Sampling(temperature=0), (), lambda e: None, gen.tokenizer)
            for p in PROMPTS[:3]]  # fmt: skip
    for job in jobs:
        scheduler.submit(job)
        time.sleep(0.01)
    deadline = time.monotonic() + 30
    while not all(j.finished for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.stop()
    assert (scheduler.stats()["batches"], scheduler.stats()["largest_batch"]) == (1, 3)


def test_concurrent_http_requests_are_batched_and_each_gets_its_own_text(tiny_export, ref):
    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bodies = [{"prompt": p, "max_tokens": 10 + i, "temperature": 0} for i, p in enumerate(PROMPTS)]
            return await asyncio.gather(*(stream_one(client, b) for b in bodies))

    with running(tiny_export, max_batch=8, batch_wait_ms=300) as (url, scheduler):
        results = asyncio.run(main(url))
        stats = wait_idle(url)
    for i, events in enumerate(results):
        assert joined(events)[0] == alone(ref, PROMPTS[i], 10 + i), f"request {i} got another text"
    assert stats["largest_batch"] > 1  # they shared a batch


def test_take_batch_groups_by_sampling_and_fits_positions(tiny_export):
    tok = TextTokenizer(tiny_export / "tokenizer.json")  # rows are never decoded here

    def job(plen, max_tokens, n=1, **s):
        return Job(["x"], [plen], n, max_tokens, Sampling(**s), (), lambda e: None, tok)

    greedy_a, sampled, greedy_long, greedy_b, seeded = (
        job(10, 20, temperature=0), job(5, 5), job(100, 28, temperature=0), job(3, 3, n=2, temperature=0),
        job(5, 5, seed=1),
    )  # fmt: skip
    waiting = deque([greedy_a, sampled, greedy_long, greedy_b, seeded])
    # greedy_long would need 100 + 28 > 120 positions next to greedy_a: it waits; sampled jobs wait too
    assert take_batch(waiting, max_batch=4, n_positions=120) == [greedy_a, greedy_b]
    assert take_batch(waiting, max_batch=4, n_positions=120) == [sampled]  # the seeded job never shares
    assert take_batch(waiting, max_batch=4, n_positions=120) == [greedy_long]
    assert list(waiting) == [seeded]
    assert take_batch(deque([job(1, 1, n=3, temperature=0), job(1, 1, n=2, temperature=0)]), 4, 120)[0].n == 3


# ---- logprobs ----------------------------------------------------------------------------------------------


def spelled(raw: list[int]) -> str:
    """OpenAI's name for a token: its text, or `bytes:\\xNN...` when its bytes are not whole UTF-8 on their own."""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def runtime_records(gen: Generator, prompt: str, max_tokens: int, n: int, ignore_eos: bool = True, **kw) -> list:
    """Generator.generate(prompt, logprobs=n) alone (greedy unless kw says otherwise): one record per token."""
    kw = GREEDY | kw
    return gen.generate(prompt, max_new_tokens=max_tokens, logprobs=n, ignore_eos=ignore_eos, **kw).logprobs


def first_chars(tok: TextTokenizer, records: list) -> list[int]:
    """By brute force from the definition: where each token starts in the text all the tokens decode to (lossy
    UTF-8, as the server's text): the index of the character holding its first byte. A token that renders as
    nothing (end of text) starts at the character at its position. Splitting the bytes at a character boundary
    does not change their decoding."""
    raws = [b"" if tok.decode([r.token_id]) == "" else bytes(r.bytes) for r in records]
    full = b"".join(raws)
    text = full.decode("utf-8", "replace")

    def boundary(p: int) -> bool:
        return full[:p].decode("utf-8", "replace") + full[p:].decode("utf-8", "replace") == text

    out, p = [], 0
    for raw in raws:
        out.append(len(full[: max(q for q in range(p + 1) if boundary(q))].decode("utf-8", "replace")))
        p += len(raw)
    return out


def reported(tok: TextTokenizer, records: list, text_len: int) -> tuple[list, list[int]]:
    """The records a completion of text_len characters reports, and their offsets in it: every token from the
    first to the last one whose bytes reach the returned text."""
    starts = first_chars(tok, records)
    k = sum(s < text_len for s in starts)
    while k and tok.decode([records[k - 1].token_id]) == "":
        k -= 1  # a token that renders as nothing, after the last character (end of text)
    return records[:k], starts[:k]


def assert_block(block: dict, tok: TextTokenizer, records: list, n: int, prompt: str, text: str) -> None:
    """A choice's OpenAI `logprobs` block holds exactly the runtime's records that reach its text, each with
    its top n (plus the chosen token) and its offset from the start of the prompt."""
    records, starts = reported(tok, records, len(text))
    assert set(block) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert block["tokens"] == [spelled(r.bytes) for r in records]
    assert block["token_logprobs"] == pytest.approx([r.logprob for r in records], abs=1e-5)
    assert block["text_offset"] == [len(prompt) + s for s in starts]
    if n == 0:
        assert block["top_logprobs"] is None  # OpenAI's answer to logprobs: 0
        return
    assert len(block["top_logprobs"]) == len(records)
    for got, r in zip(block["top_logprobs"], records):
        want = {spelled(t.bytes): t.logprob for t in r.top_logprobs[:n]}
        want.setdefault(spelled(r.bytes), r.logprob)  # the chosen token is always listed (up to n + 1 entries)
        assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)


def stream_chunks(events: list) -> dict[int, list]:
    """Each choice's (text, logprobs block) per chunk, in order (usage chunk and [DONE] left out)."""
    out: dict[int, list] = {}
    for e in events:
        if e != "[DONE]":
            for c in e["choices"]:
                out.setdefault(c["index"], []).append((c["text"], c["logprobs"]))
    return out


def joined_block(chunks: list, prompt: str) -> dict | None:
    """A choice's chunks as one block; checks that each chunk carries the tokens that start in its own text."""
    if chunks[0][1] is None:
        assert all(lp is None for _, lp in chunks)
        return None
    block: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    start = len(prompt)
    for text, lp in chunks:
        assert all(start <= o < start + len(text) for o in lp["text_offset"]), (text, lp, start)
        for key in block:
            block[key] += lp[key] or []
        start += len(text)
    if all(lp["top_logprobs"] is None for _, lp in chunks):
        block["top_logprobs"] = None
    return block


@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_equal_the_runtime_alone(server, ref, n):
    """Plain and streamed, on prompts whose continuations split characters over tokens (and leave some
    incomplete): the runtime's tokens and values, each streamed with the chunk that holds its first character."""
    for prompt in PROMPTS[:4] + PROMPTS[7:]:
        body = {"prompt": prompt, "max_tokens": 14, "temperature": 0, "ignore_eos": True, "logprobs": n}
        choice = post(server, body).json()["choices"][0]
        assert choice["text"] == alone(ref, prompt, 14, ignore_eos=True)
        assert_block(choice["logprobs"], ref.tokenizer, runtime_records(ref, prompt, 14, n), n, prompt, choice["text"])
        chunks = stream_chunks(asyncio.run(_stream(server, body)))[0]
        assert "".join(t for t, _ in chunks) == choice["text"]
        assert joined_block(chunks, prompt) == choice["logprobs"]


def test_logprobs_stop_where_the_text_stops(server, ref):
    """A stop string drops the tokens after the returned text (keeping one it starts inside); end of text is
    not a token of the text."""
    prompt = PROMPTS[3]
    records = runtime_records(ref, prompt, 40, 1)
    full = alone(ref, prompt, 40, ignore_eos=True)
    for cut in (3, 12, 13, 20, 31):
        stop = full[cut : cut + 2]
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 1, "stop": stop}
        choice = post(server, body).json()["choices"][0]
        text = full[: full.find(stop)]
        assert (choice["text"], choice["finish_reason"]) == (text, "stop")
        assert_block(choice["logprobs"], ref.tokenizer, records, 1, prompt, text)
        assert len(choice["logprobs"]["tokens"]) < len(records)
        chunks = stream_chunks(asyncio.run(_stream(server, body)))[0]
        assert "".join(t for t, _ in chunks) == text
        assert joined_block(chunks, prompt) == choice["logprobs"]
    # a seeded sampled request runs alone: it is the runtime's sampled run with that seed, up to end of text
    sampled = dict(do_sample=True, temperature=1.5, top_p=1.0)
    seed = next(s for s in range(200) if ref.generate(prompt, max_new_tokens=60, seed=s, **GREEDY | sampled)
                .finish_reason == "eos")  # fmt: skip
    records = runtime_records(ref, prompt, 60, 2, ignore_eos=False, seed=seed, **sampled)
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 1.5, "seed": seed, "logprobs": 2}
    choice = post(server, body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and records[-1].token_id in ref.eos_token_id
    assert_block(choice["logprobs"], ref.tokenizer, records, 2, prompt, choice["text"])
    assert len(choice["logprobs"]["tokens"]) < len(records)  # <|endoftext|> is not reported


def test_logprobs_with_n_choices_and_prompts(server, ref):
    body = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    for c in post(server, body).json()["choices"]:
        prompt = PROMPTS[c["index"] // 2]
        assert_block(c["logprobs"], ref.tokenizer, runtime_records(ref, prompt, 8, 3), 3, prompt, c["text"])
    # sampled choices differ; each block is its own text's
    body = dict(body, prompt=PROMPTS[0], n=3, temperature=1.0, seed=5)
    choices = post(server, body).json()["choices"]
    assert len({c["text"] for c in choices}) > 1
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["text_offset"]) > 0 and lp["text_offset"][0] == len(PROMPTS[0])
        assert all(len(top) <= 4 and top[t] == v for t, v, top in zip(lp["tokens"], lp["token_logprobs"],
                                                                       lp["top_logprobs"]))  # fmt: skip


def test_logprobs_in_a_shared_batch_each_get_their_own_n(tiny_export, ref):
    """Requests with different logprobs (and none), plain and streamed, decode in one batch; each gets what it
    gets alone."""
    specs = list(zip(PROMPTS, [None, 0, 1, 3, 5, 2, None, 4]))

    def body(prompt, n):
        lp = {} if n is None else {"logprobs": n}
        return {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True} | lp

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            plain = [client.post("/v1/completions", json=body(p, n)) for p, n in specs[:4]]
            streamed = [stream_one(client, body(p, n)) for p, n in specs[4:]]
            return await asyncio.gather(*plain, *streamed)

    with running(tiny_export, max_batch=8, batch_wait_ms=300) as (url, _):
        results = asyncio.run(main(url))
        stats = wait_idle(url)
    assert stats["largest_batch"] > 1  # they shared a batch
    for i, ((prompt, n), res) in enumerate(zip(specs, results)):
        if i < 4:
            choice = res.json()["choices"][0]
            text, block = choice["text"], choice["logprobs"]
        else:
            chunks = stream_chunks(res)[0]
            text, block = "".join(t for t, _ in chunks), joined_block(chunks, prompt)
        assert text == alone(ref, prompt, 10, ignore_eos=True), f"request {i} got another text"
        if n is None:
            assert block is None
        else:
            assert_block(block, ref.tokenizer, runtime_records(ref, prompt, 10, n), n, prompt, text)


def test_max_tokens_0_with_echo_returns_the_prompt(server, ref):
    prompts = ["The city", "", "Über café"]
    before = httpx.get(server + "/health").json()["batches"]
    r = post(server, {"prompt": prompts, "n": 2, "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (i, prompts[i // 2], "length") for i in range(6)
    ]
    prompt_tokens = sum(len(ref.tokenizer.encode(p)) or 1 for p in prompts)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    events = asyncio.run(_stream(server, {"prompt": prompts[2], "max_tokens": 0, "echo": True,
                                          "stream_options": {"include_usage": True}}))  # fmt: skip
    assert joined(events[:-1])[0] == prompts[2] and events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 0 and events[-1] == "[DONE]"
    assert httpx.get(server + "/health").json()["batches"] == before  # nothing was decoded
    # without echo there is nothing to return: OpenAI refuses it, naming echo
    err = post(server, {"prompt": "a", "max_tokens": 0}).json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]


# ---- bad input -------------------------------------------------------------------------------------------------

BAD = {
    "malformed JSON": (b'{"prompt": "a",', 400, None),
    "not UTF-8": (b'{"prompt": "\xff\xfe"}', 400, None),
    "not an object": (b"[1, 2]", 400, None),
    "NaN": (b'{"prompt": "a", "temperature": NaN}', 400, None),
    "unknown field": ({"prompt": "a", "max_token": 5}, 400, "max_token"),
    "missing prompt": ({"max_tokens": 5}, 400, "prompt"),
    "negative max_tokens": ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    "zero max_tokens without echo": ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    "huge max_tokens": ({"prompt": "a", "max_tokens": 10**40}, 400, "max_tokens"),
    "max_tokens past positions": ({"prompt": "a", "max_tokens": 128}, 400, "max_tokens"),
    "string max_tokens": ({"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    "bool n": ({"prompt": "a", "n": True}, 400, "n"),
    "n over the limit": ({"prompt": "a", "n": 9}, 400, "n"),
    "prompts x n over max_batch": ({"prompt": ["a"] * 5, "n": 2}, 400, "n"),
    "prompt over n_positions": ({"prompt": "word " * 200}, 400, "prompt"),
    "prompt plus max_tokens over n_positions": ({"prompt": "a b c d e f", "max_tokens": 125}, 400, "prompt"),
    "token-id prompt": ({"prompt": [1, 2, 3]}, 400, "prompt"),
    "empty prompt list": ({"prompt": []}, 400, "prompt"),
    "logprobs over the limit": ({"prompt": "a", "logprobs": 6}, 400, "logprobs"),
    "negative logprobs": ({"prompt": "a", "logprobs": -1}, 400, "logprobs"),
    "float logprobs": ({"prompt": "a", "logprobs": 1.5}, 400, "logprobs"),
    "bool logprobs": ({"prompt": "a", "logprobs": True}, 400, "logprobs"),
    "string logprobs": ({"prompt": "a", "logprobs": "2"}, 400, "logprobs"),
    "echo with logprobs": ({"prompt": "a", "logprobs": 0, "echo": True}, 400, "logprobs"),
    "five stop strings": ({"prompt": "a", "stop": list("abcde")}, 400, "stop"),
    "empty stop string": ({"prompt": "a", "stop": [""]}, 400, "stop"),
    "temperature out of range": ({"prompt": "a", "temperature": 3}, 400, "temperature"),
    "negative seed": ({"prompt": "a", "seed": -1}, 400, "seed"),
    "presence_penalty out of range": ({"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    "duplicate key": (b'{"prompt": "a", "prompt": ["b", "c"]}', 400, "prompt"),
    "duplicate nested key": (b'{"prompt": "a", "stream": true, "stream_options": {"include_usage": true, '
                             b'"include_usage": false}}', 400, "include_usage"),
    "unknown stream_options field": ({"prompt": "a", "stream": True, "stream_options": {"x": 1}}, 400,
                                     "stream_options.x"),
    "logit_bias key not an id": ({"prompt": "a", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    "logit_bias id past the vocabulary": ({"prompt": "a", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    "logit_bias value out of range": ({"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    "stop_token_ids past the vocabulary": ({"prompt": "a", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    "min_tokens over max_tokens": ({"prompt": "a", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
    "top_k below -1": ({"prompt": "a", "top_k": -2}, 400, "top_k"),
    "repetition_penalty 0": ({"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    "stream_options without stream": ({"prompt": "a", "stream_options": {}}, 400, "stream_options"),
    "unknown model": ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
    "body over the limit": (json.dumps({"prompt": "a" * (1 << 20)}).encode(), 413, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_an_openai_error_and_the_server_stays_up(server, case):
    body, status, param = BAD[case]
    r = post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].endswith(".") and "Traceback" not in err["message"]
    assert post(server, {"prompt": "a", "max_tokens": 2}).status_code == 200


def test_unknown_route_and_method_are_openai_errors(server):
    assert httpx.get(server + "/v1/nothing").json()["error"]["code"] == "not_found"
    assert httpx.get(server + "/v1/completions").status_code == 405


def test_queue_full_gets_429(tiny_export):
    """One request decodes (slowly), one waits: with --max-queue 1 the third gets 429, and the first two finish."""

    async def until(client, key, value):
        for _ in range(500):
            if (await client.get("/health")).json()[key] >= value:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{key} never reached {value}")

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"prompt": "a", "max_tokens": 30, "ignore_eos": True}
            running = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await until(client, "running", 1)
            queued = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await until(client, "waiting", 1)
            refused = await client.post("/v1/completions", json=body)
            return await running, await queued, refused

    with running(tiny_export, delay=0.05, max_batch=1, max_queue=1) as (url, _):
        first, second, third = asyncio.run(main(url))
    assert first.status_code == second.status_code == 200
    assert third.status_code == 429
    assert third.json()["error"] == {
        "message": "The server is busy (1 requests already queued); retry shortly.",
        "type": "rate_limit_error",
        "param": None,
        "code": "queue_full",
    }


# ---- clients that leave -------------------------------------------------------------------------------------


def test_a_client_leaving_mid_stream_frees_its_row(tiny_export, ref):
    with running(tiny_export, delay=0.02, max_batch=1) as (url, _):
        body = {"prompt": "The city", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        events = asyncio.run(_stream(url, body, leave_after=2))
        assert len(events) == 2
        # the row was dropped mid-decode (not run to its 100 tokens), and the next client is served normally
        assert wait_idle(url)["dropped_rows"] == 1
        r = post(url, {"prompt": "A", "max_tokens": 5, "temperature": 0}).json()
        assert r["choices"][0]["text"] == alone(ref, "A", 5)


def test_a_non_streaming_client_that_times_out_frees_its_row(tiny_export):
    with running(tiny_export, delay=0.02, max_batch=1) as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            post(url, {"prompt": "a", "max_tokens": 100, "ignore_eos": True}, timeout=0.3)
        assert wait_idle(url)["dropped_rows"] == 1


def test_64_clients_half_leaving_mid_stream(tiny_export, ref):
    """Half of 64 concurrent streams are abandoned after their first event: the rest get exactly their own
    text, the server serves on, returns to idle, and keeps no request objects behind (three rounds)."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    expected = [alone(ref, p, 24, ignore_eos=True) for p in prompts]

    async def storm(url):
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in prompts]
            return await asyncio.gather(*(stream_one(client, b, 1 if i % 2 else None) for i, b in enumerate(bodies)))

    with running(tiny_export, delay=0.005, max_batch=16, max_queue=64) as (url, scheduler):
        rss = []
        for _ in range(3):
            results = asyncio.run(storm(url))
            for i in range(0, 64, 2):
                assert joined(results[i])[0] == expected[i], f"client {i} got another text"
                assert results[i][-1] == "[DONE]"
            stats = wait_idle(url)
            assert (stats["waiting"], stats["running"]) == (0, 0)
            gc.collect()
            rss.append(_rss_mb())
        assert stats["dropped_rows"] + stats["dropped_waiting"] > 0  # some really left mid-way
        assert not [o for o in gc.get_objects() if isinstance(o, Job)]  # nothing retained
        if rss[0] is not None:
            assert rss[2] - rss[0] < 25, f"resident memory grew {rss} MB over rounds"
        assert post(url, {"prompt": "A", "max_tokens": 5, "temperature": 0}).json()["choices"][0]["text"] == alone(
            ref, "A", 5
        )


def _rss_mb() -> float | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


# ---- per-row text ---------------------------------------------------------------------------------------------


def _tokenizers(tiny_export, tmp_path):
    """The tiny model's tokenizer, and GPT-2's real one where /work/shared has it."""
    yield TextTokenizer(tiny_export / "tokenizer.json")
    shared = Path("/work/shared/gpt2-tokenizer")
    if (shared / "vocab.json").exists():
        from tokenizers import Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        tok = Tokenizer(BPE.from_file(str(shared / "vocab.json"), str(shared / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.save(str(tmp_path / "gpt2.json"))
        yield TextTokenizer(tmp_path / "gpt2.json")


def test_row_text_never_splits_a_character_and_cuts_at_stop(tiny_export, tmp_path):
    text = "Grüße aus Köln, 東京 and 🙂 emoji; naïve café."
    for tok in _tokenizers(tiny_export, tmp_path):
        ids = tok.encode(text)
        # the test means something only if some character spans several tokens
        assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
        row = TextStream(tok)
        pieces = []
        for i in ids:
            row.push(i)
            pieces.append(row.take())
        row.finish()
        pieces.append(row.take())
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)
        for stop in ("東京", "ü", "aus K", "i; n", "🙂"):
            row = TextStream(tok, [stop, "never there"])
            out, hit = "", False
            for i in ids:
                hit = row.push(i)
                out += row.take()
                if hit:
                    break
            assert hit and out == text[: text.find(stop)], stop


def test_row_logprobs_go_out_with_their_text(tiny_export, tmp_path):
    """Row by row, as the scheduler feeds it: each token goes out with the piece that holds its first character
    (never ahead of it: a character split over tokens, text held as a possible stop string), none past the
    text a stop string cuts, and the offsets are where the tokens start."""
    text = "Grüße aus Köln, 東京 and 🙂 emoji; naïve café."
    for tok in _tokenizers(tiny_export, tmp_path):
        recorder = LogprobRecorder(tok, 0, 1)
        ids = tok.encode(text)
        records = [TokenLogprob(i, *recorder.token(i)[:1], -0.5 * k, recorder.token(i)[1]) for k, i in enumerate(ids)]
        for stop in ((), ("東京",), ("ü",), ("aus K",), ("i; n",), ("🙂",)):
            pieces: list[Piece] = []
            job = Job(["P:"], [2], 1, len(ids), Sampling(temperature=0), stop, pieces.append, tok, logprobs=0)
            row = job.rows[0]
            row.decoder = RowDecoder(SamplingParams(max_new_tokens=len(ids)), (), row.text, width=1)
            for i, record in zip(ids, records):
                advance(row, row.decoder.push(i), record)
                if row.done:
                    break
            sent = "".join(p.text for p in pieces)
            assert pieces[-1].finish_reason == ("stop" if stop else "length")
            assert sent == (text[: text.find(stop[0])] if stop else text)
            want, starts = reported(tok, records, len(sent))
            start = 2
            for p in pieces:
                assert all(start <= e.offset < start + len(p.text) for e in p.logprobs), (stop, p)
                start += len(p.text)
            got = [e for p in pieces for e in p.logprobs]
            assert [(e.token, e.logprob, e.offset) for e in got] == [
                (spelled(r.bytes), r.logprob, 2 + s) for r, s in zip(want, starts)
            ], stop
            assert len(got) < len(ids) if stop else len(got) == len(ids)


def test_cli_serve_starts_serves_and_stops(tiny_export):
    proc = python_child("-m", "gpt2edge.cli", "serve", str(tiny_export), "--port", "0", "--model-name", "tiny")
    log: list[str] = []
    try:
        line = proc.stdout.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert found, line + proc.stderr.read()
        url = found.group(1)
        # the server answers (503 "loading") while the model loads on a thread: wait for the line that says it
        # is loaded, not for a time (a loaded machine once took longer than the first request)
        for err in proc.stderr:
            log.append(err)
            if "model tiny loaded" in err or "loading the model failed" in err:
                break
        assert log and "model tiny loaded" in log[-1], "".join(log)
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 200 and health.json()["model"] == "tiny", health.text
        assert post(url, {"prompt": "a", "max_tokens": 3}).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    assert rc == 0, "".join(log) + proc.stderr.read()


def test_cli_serve_notes_from_the_model_load_have_the_servers_form(tiny_export):
    """The scheduler is built on a thread that starts before the server is imported: its notes (here: a prefix
    cache the next-batch scheduler ignores) are printed as the server's own lines ("WARNING: ..."), not raw."""
    args = [str(tiny_export), "--port", "0", "--model-name", "tiny", "--scheduler", "next-batch"]
    proc = python_child("-m", "gpt2edge.cli", "serve", *args, "--prefix-cache-bytes", "1M")
    log: list[str] = []
    try:
        for err in proc.stderr:
            log.append(err)
            if "model tiny loaded" in err or "loading the model failed" in err:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert "WARNING: --prefix-cache-bytes is ignored: the next-batch scheduler has no prefix cache\n" in log, log


@pytest.mark.parametrize(
    "args, message",
    [
        (["/no/such/folder"], "error: "),
        (["{dir}", "--max-batch", "0"], "Invalid value for '--max-batch'"),
        (["{dir}", "--max-queue", "0"], "Invalid value for '--max-queue'"),
        (["{dir}", "--ray", "--port", "0"], "Ray Serve needs a fixed port"),
        (["{dir}", "--replicas", "2"], "--replicas and --ray-address need --ray"),
    ],
)
def test_cli_serve_refuses_bad_options_in_one_line(tiny_export, args, message):
    from click.testing import CliRunner

    from gpt2edge.cli import main

    result = CliRunner().invoke(main, ["serve", *(a.format(dir=tiny_export) for a in args)])
    assert result.exit_code != 0 and message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["generate", "bench", "score", "serve"])
def test_every_threads_option_takes_the_runtime_range(tiny_export, command):
    """One --threads range everywhere: the runtime's bound, checked by click before anything loads."""
    from click.testing import CliRunner

    from gpt2edge.cli import main
    from gpt2edge.runtime.model.ort_session import MAX_THREADS

    option = next(p for p in main.commands[command].params if p.name == "threads")
    assert (option.type.min, option.type.max) == (1, MAX_THREADS)
    assert f"1..{MAX_THREADS}" in option.help
    args = {"generate": ["-p", "x"], "bench": [], "score": [], "serve": ["--port", "0"]}[command]
    for bad in ("0", str(MAX_THREADS + 1)):
        result = CliRunner().invoke(main, [command, str(tiny_export), *args, "--threads", bad])
        assert result.exit_code == 2 and "Invalid value for '-t' / '--threads'" in result.output, result.output


@pytest.mark.parametrize("flags, missing, extra, feature", [
    ([], "uvicorn", "serve", "serve"),
    (["--ray", "--port", "8123"], "ray", "cluster", "serve --ray"),
])  # fmt: skip
def test_cli_serve_names_a_missing_extra_like_every_command(tiny_export, monkeypatch, flags, missing, extra, feature):
    from click.testing import CliRunner

    from gpt2edge.cli import main

    monkeypatch.setitem(sys.modules, missing, None)  # find_spec() reports it absent
    result = CliRunner().invoke(main, ["serve", str(tiny_export), "--port", "0", *flags])
    assert result.exit_code == 1
    assert result.output == (
        f"error: gpt2edge {feature} needs the {extra} extra ({missing} not installed): "
        f"pip install 'gpt2edge[{extra}]'.\n"
    )


def test_a_folders_min_p_does_not_leak_into_sampled_requests(tiny_export, ref, tmp_path):
    """OpenAI has no min_p: a sampled request is the runtime's sampling with only the request's temperature and
    top_p, whatever generation_config.json says (min_p cannot be passed as 'off', so the server must drop it)."""
    folder = tmp_path / "min_p"
    shutil.copytree(tiny_export, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "min_p": 0.9, "do_sample": True}))
    write_manifest(folder, dict(load_manifest(folder).raw))
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 1.5, "top_p": 1.0, "ignore_eos": True}
    with running(folder, max_batch=8, batch_wait_ms=10) as (url, _):
        texts = {s: post(url, dict(body, seed=s)).json()["choices"][0]["text"] for s in range(3)}
    for s, text in texts.items():
        want = ref.generate(PROMPTS[0], max_new_tokens=24, seed=s, ignore_eos=True,
                            **GREEDY | dict(do_sample=True, temperature=1.5, top_p=1.0)).text  # fmt: skip
        assert text == want, f"seed {s}: the folder's min_p changed the sampled text"
