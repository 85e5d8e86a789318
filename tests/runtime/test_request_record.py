"""One request record: SamplingParams. The Generator's keys are derived from it; the CLI's options, the server's
fields, the speculative support list and the browser runtime's keys are checked against it here, so a knob added
to the record and forgotten elsewhere fails this test instead of silently doing nothing there."""

import dataclasses
import re
from pathlib import Path

import pytest

from gpt2edge.runtime.call_params import CONFIG_KEYS, RESOLVED, SAMPLING_KNOBS
from gpt2edge.runtime.decoding.sampling_params import SamplingParams
from gpt2edge.runtime.speculative.rules import HANDLED_PARAMS

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# the server's names for the record's knobs where OpenAI spells them otherwise
SERVER_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
CLI_NAMES = {"bad_words_ids": "ban"}  # --ban takes strings; the Generator turns them into bad_words_ids
# knobs the OpenAI server does not offer, and why (anything else missing there fails the test)
SERVER_OMITS = {
    "do_sample": "OpenAI's temperature 0 is greedy",
    "no_repeat_ngram_size": "transformers' own; no OpenAI, vLLM or llama-server field",
    "bad_words_ids": "transformers' own; logit_bias -100 bans a token",
}


def test_the_generators_keys_are_the_record():
    assert set(CONFIG_KEYS) | set(RESOLVED) == FIELDS and not set(CONFIG_KEYS) & set(RESOLVED)
    assert set(SAMPLING_KNOBS) <= set(CONFIG_KEYS)
    assert HANDLED_PARAMS <= FIELDS  # speculative decoding's support list names only record fields


def test_the_cli_has_an_option_for_every_knob():
    from gpt2edge.cli import main

    names = {p.name for p in main.commands["generate"].params}
    missing = [k for k in (*CONFIG_KEYS, "seed", "stop", "ignore_eos") if CLI_NAMES.get(k, k) not in names]
    assert not missing, f"gpt2edge generate has no option for {missing}"


def test_the_server_has_a_field_for_every_knob_and_passes_each_on():
    pytest.importorskip("fastapi", reason="fastapi is not installed (serve extra)")
    from gpt2edge.serve.api.protocol import CompletionRequest
    from gpt2edge.serve.scheduling.jobs import Sampling

    fields = set(CompletionRequest.model_fields)
    missing = [k for k in CONFIG_KEYS if k not in SERVER_OMITS and SERVER_NAMES.get(k, k) not in fields]
    assert not missing, f"the server has no field for {missing}"
    # every Sampling field reaches the Generator, under the record's own name
    sampled = Sampling(temperature=0.5, seed=1).generate_kwargs()
    taken = set(sampled) - {"folder_defaults", "ignore_eos", "seed"}
    assert taken <= set(CONFIG_KEYS)
    offered = {f.name for f in dataclasses.fields(Sampling)} - {"constraint", "ignore_eos", "seed"}
    assert {SERVER_NAMES.get(k, k) for k in taken} == offered | {"do_sample"}  # (do_sample: from temperature)


def _js_array(src: str, name: str) -> list[str]:
    body = re.search(rf"const {name} = \[(.*?)\];", src, re.S)
    assert body, f"web/src/generator.js has no {name}"
    return re.findall(r'"([a-z_]+)"', body.group(1))


def test_the_browser_runtimes_keys_are_the_records():
    src = (Path(__file__).resolve().parents[2] / "web" / "src" / "generator.js").read_text()
    keys, knobs = _js_array(src, "CONFIG_KEYS"), _js_array(src, "SAMPLING_KNOBS")
    assert set(keys) <= set(CONFIG_KEYS), set(keys) - set(CONFIG_KEYS)
    assert knobs == [k for k in SAMPLING_KNOBS if k in keys]  # the same rule: giving one turns sampling on


def test_a_request_resolved_once_generates_what_the_call_does(tiny_export):
    """Generator.request resolves a call (parameters, search mode, constraint, prompts) before any model work;
    generate() and stream() take it as it is and give the call's own tokens."""
    from gpt2edge.errors import GenerationError
    from gpt2edge.runtime import GenerationRequest, Generator

    gen = Generator(tiny_export)
    kw = dict(max_new_tokens=6, do_sample=True, seed=5, temperature=0.9, presence_penalty=0.5, stop=["zz"])
    req = gen.request("The river rose", **kw)
    assert isinstance(req, GenerationRequest) and req.prompts == (tuple(gen.tokenizer.encode("The river rose")),)
    direct = gen.generate("The river rose", **kw)
    assert gen.generate(req).token_ids == direct.token_ids
    result: list = []
    assert "".join(gen.stream(req, result=result)) == direct.text and result[0].token_ids == direct.token_ids
    batch = gen.request(["A", "The city"], max_new_tokens=3, do_sample=False)
    assert [r.token_ids for r in gen.generate(batch)] == [
        r.token_ids for r in gen.generate(["A", "The city"], max_new_tokens=3, do_sample=False)
    ]
    with pytest.raises(GenerationError, match="carries its options; pass seed"):
        gen.generate(req, seed=1)  # an option beside a request would be silently lost
    with pytest.raises(GenerationError, match="one prompt and one sequence"):
        gen.stream(batch)
    with pytest.raises(GenerationError, match="positions"):  # checked at resolve time, before any model work
        gen.request("a " * 5000, max_new_tokens=4)
