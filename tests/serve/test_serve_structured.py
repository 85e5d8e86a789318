"""Structured output on the server: OpenAI's response_format, llama-server's json_schema / grammar and vLLM's
guided_* fields each map to the runtime's Constraint; constrained and free rows share a continuous batch (the
free ones keep their tokens alone, the constrained ones get Generator.generate(constraint=...)'s); streams join
to a valid document; bad input is a 400 with the engine's reason before the request takes a row."""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
pytest.importorskip("llguidance", reason="the structured extra is not installed: pip install 'gpt2edge[structured]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")
jsonschema = pytest.importorskip("jsonschema")

from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.runtime.constraints import Constraint, cache_info  # noqa: E402
from tests.support.serve import GREEDY, alone, joined, post, running, stream_one  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                   "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}  # fmt: skip
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
GREEDY_BODY = {"temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def ref(tiny_export) -> Generator:
    return Generator(tiny_export)


@pytest.fixture(scope="module")
def server(tiny_export, tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured") / "tiny-chat"
    shutil.copytree(tiny_export, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    with running(folder, max_batch=8) as (url, scheduler):
        yield url, scheduler


def valid_json(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


CASES = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     valid_json),
    ({"response_format": {"type": "json_object"}}, None),  # any object: a random model may not close it
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, valid_json),  # llama-server's form
    ({"json_schema": SCHEMA}, valid_json),
    ({"guided_json": SCHEMA}, valid_json),
    ({"guided_json": json.dumps(SCHEMA)}, valid_json),
    ({"grammar": 'root ::= "(" [0-9]{1,3} ")"'}, lambda t: re.fullmatch(r"\([0-9]{1,3}\)", t)),
    ({"guided_grammar": 'start: "<" WORD ">"\nWORD: /[a-z]{1,4}/'}, lambda t: re.fullmatch(r"<[a-z]{1,4}>", t)),
    ({"guided_regex": "[0-9]{4}-[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}", t)),
    ({"guided_choice": ["yes", "no", "maybe not"]}, lambda t: t in ("yes", "no", "maybe not")),
]  # fmt: skip


@pytest.mark.parametrize("fields,check", CASES, ids=[next(iter(c[0])) + str(i) for i, c in enumerate(CASES)])
def test_each_field_kind_gives_output_that_parses(server, fields, check):
    for sampled in ({}, {"temperature": 1.0, "seed": 5, "n": 3}):
        r = post(server[0], {"prompt": "The", **GREEDY_BODY, **fields, **sampled})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            if check is None:  # any JSON object: complete and parsing, or cut by max_tokens inside it
                assert c["text"].startswith("{") and c["finish_reason"] in ("stop", "length"), c
                assert c["finish_reason"] == "length" or isinstance(json.loads(c["text"]), dict), c
                continue
            assert c["finish_reason"] == "stop" and check(c["text"]), c


def test_text_response_format_is_free(server, ref):
    r = post(server[0], {"prompt": "The", **GREEDY_BODY, "response_format": {"type": "text"}, "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == alone(ref, "The", 48, ignore_eos=True)


def test_chat_completions_take_response_format(server):
    body = {"messages": [{"role": "user", "content": "Who?"}], **GREEDY_BODY,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}  # fmt: skip
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    valid_json(r.json()["choices"][0]["message"]["content"])


def test_a_mixed_batch_keeps_free_rows_alone_and_constrained_rows_the_runtimes(server, ref, monkeypatch):
    """Constrained and free requests at once in one continuous batch (greedy): each free one equals its
    unconstrained-alone text, each constrained one Generator.generate(constraint=...)'s text."""
    url, scheduler = server
    free = [("The river rose and", 70), ("A", 64), ("Snow fell on the quiet hills", 60)]
    constrained = [
        ("The", {"guided_json": SCHEMA}, Constraint.json_schema(SCHEMA)),
        ("Date:", {"guided_regex": "[0-9]{4}-[0-9]{2}"}, Constraint.regex("[0-9]{4}-[0-9]{2}")),
        ("Q", {"guided_choice": ["yes", "no"]}, Constraint.choice(["yes", "no"])),
    ]
    bodies = [{"prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True} for p, m in free]
    bodies += [{"prompt": p, "max_tokens": 48, "temperature": 0, **f} for p, f, _ in constrained]
    kinds: list[set[bool]] = []  # per step: whether its rows are free, constrained, or both
    sample = scheduler._sample

    def recording(lp, cache_rows):
        kinds.append({scheduler._cache_rows[c][0].group.constraint is None for c in cache_rows})
        return sample(lp, cache_rows)

    for _, _, c in constrained:  # compiled (and the engine's tokenizer built) before the race: they join at once
        scheduler.compile(c)
    monkeypatch.setattr(scheduler, "_sample", recording)
    monkeypatch.setattr(scheduler, "delay", 0.01)  # steps slow enough for every request to join the batch

    async def all_at_once():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    got = [r.json()["choices"][0]["text"] for r in asyncio.run(all_at_once())]
    for (p, m), text in zip(free, got):
        assert text == alone(ref, p, m, ignore_eos=True)
    for (p, _, c), text in zip(constrained, got[len(free) :]):
        want = ref.generate(p, constraint=c, max_new_tokens=48, **GREEDY)
        assert text == want.text, (p, text, want.text)
    assert {True, False} in kinds  # free and constrained rows were decoded in one step


def test_stream_joins_to_a_valid_document(server, ref):
    body = {"prompt": "The", **GREEDY_BODY, "response_format": {"type": "json_schema",
            "json_schema": {"name": "p", "schema": SCHEMA}}}  # fmt: skip

    async def go():
        async with httpx.AsyncClient(base_url=server[0], timeout=60) as client:
            return await stream_one(client, body)

    events = asyncio.run(go())
    text = joined(events)[0]
    valid_json(text)
    assert text == ref.generate("The", constraint=Constraint.json_schema(SCHEMA), max_new_tokens=48, **GREEDY).text
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_inside_a_structure_is_length(server):
    r = post(server[0], {"prompt": "The", "max_tokens": 3, "temperature": 0, "json_schema": SCHEMA})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["text"].startswith('{"')


@pytest.mark.parametrize(
    "fields,param,match",
    [
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema", "does not support: uniqueItems"),
        ({"guided_json": "{bad"}, "guided_json", "not valid JSON"),
        ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json", "Unsatisfiable"),
        ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
        ({"grammar": "root ::= missing"}, "grammar", "not found"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be text, json_object or json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
         "response_format", "strict must be a boolean"),
        ({"guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_choice", "guided_regex and guided_choice"),
        ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar",
         "response_format and grammar"),
        ({"guided_choice": "yes"}, "guided_choice", "valid list"),
        ({"grammar": {"root": "x"}}, "grammar", "string"),
        ({"json_schema": "{}"}, "json_schema", "dictionary"),
        ({"guided_json": {"items": {}} | {"x": "y" * 300_000}}, "guided_json", "limit is"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_with_the_engines_reason(server, fields, param, match):
    url, scheduler = server
    rows_before = scheduler.stats()["rows_served"]
    r = post(url, {"prompt": "The", "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err
    assert "\n" not in err["message"]
    assert scheduler.stats()["rows_served"] == rows_before  # refused at admission: it never took a row
    assert post(url, {"prompt": "The", "max_tokens": 2}).status_code == 200  # and the server is still up


def test_without_llguidance_the_400_names_the_extra(server, monkeypatch):
    from gpt2edge import extras

    real = extras.find_spec
    monkeypatch.setattr(extras, "find_spec", lambda name: None if name == "llguidance" else real(name))
    r = post(server[0], {"prompt": "The", "max_tokens": 4, "guided_regex": "[a-z]+"})
    assert r.status_code == 400 and "pip install 'gpt2edge[structured]'" in r.json()["error"]["message"]


def test_a_repeated_schema_compiles_once(server):
    schema = dict(SCHEMA, title="compiled-once")  # a schema no other test sends
    before = cache_info()
    for _ in range(3):
        assert post(server[0], {"prompt": "The", "max_tokens": 8, "json_schema": schema}).status_code == 200
    after = cache_info()
    assert after["misses"] - before["misses"] == 1 and after["hits"] - before["hits"] >= 2


def test_next_batch_scheduler_drives_the_runtime_with_the_constraint(tiny_export, ref):
    with running(tiny_export, scheduler="next-batch", max_batch=4) as (url, _):
        r = post(url, {"prompt": "The", **GREEDY_BODY, "guided_json": SCHEMA})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        valid_json(c["text"])
        want = ref.generate("The", constraint=Constraint.json_schema(SCHEMA), max_new_tokens=48, **GREEDY)
        assert c["text"] == want.text and c["finish_reason"] == "stop"
        assert post(url, {"prompt": "The", "max_tokens": 4, "guided_regex": "(ab"}).status_code == 400


def test_a_seeded_constrained_request_gets_the_runtimes_draws(server, ref):
    from gpt2edge.serve.scheduling.jobs import Sampling

    body = {"prompt": "The", "max_tokens": 48, "temperature": 1.0, "seed": 7, "guided_json": SCHEMA}
    text = post(server[0], body).json()["choices"][0]["text"]
    kwargs = Sampling(temperature=1.0, seed=7).generate_kwargs()
    want = ref.generate("The", constraint=Constraint.json_schema(SCHEMA), max_new_tokens=48, **kwargs)
    assert text == want.text
    valid_json(text)


def test_an_engine_failure_mid_decode_fails_its_job_alone(server, ref, monkeypatch):
    """A plain exception from the engine (llguidance raises them) ends the constrained job with an error; the
    free request decoded beside it still gets its whole text."""
    from gpt2edge.runtime.constraints.rows import ConstrainedRows

    url, scheduler = server

    def broken(self, *args, **kwargs):
        raise RuntimeError("engine state lost")

    monkeypatch.setattr(ConstrainedRows, "masks", broken)
    monkeypatch.setattr(scheduler, "delay", 0.01)  # steps slow enough for both to share the batch
    free = {"prompt": "The river rose and", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    bad = {"prompt": "The", "guided_regex": "[0-9]{4}", **GREEDY_BODY}

    async def both():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(client.post("/v1/completions", json=free),
                                        client.post("/v1/completions", json=bad))  # fmt: skip

    ok, failed = asyncio.run(both())
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == alone(ref, free["prompt"], 40, ignore_eos=True)
    assert failed.status_code >= 400 and "engine state lost" in failed.text
    # the server lives on
    assert post(url, {"prompt": "a", "max_tokens": 2}).status_code == 200
