"""What an outside attack found past the first hardening round: request fields read too loosely (Unicode digits as
token ids, a field's error under another's name), a key that can never match, and work with no bound on the
event loop (chat templates that amplify their input, tokenizing a prompt far over the context), HTTP heads that
slip past the header cap or frame their body twice, and streams cut at shutdown without an error event."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")

from test_serve import post, running  # noqa: E402

from gpt2edge.errors import ServeError  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def chat_folder(tiny_export, tmp_path_factory):
    out = tmp_path_factory.mktemp("bounds") / "tiny-chat"
    shutil.copytree(tiny_export, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def server(chat_folder):
    with running(chat_folder, max_batch=8) as (url, scheduler):
        yield url, scheduler


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"].endswith(".") and "Traceback" not in err["message"]
    return err


# ---- a non-ASCII API key -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["clé-secrète", "ключ", "鍵", "café"])
def test_a_non_ascii_api_key_is_refused_at_start(key, tiny_export):
    with pytest.raises(ServeError, match="--api-key must be ASCII"):
        ServeConfig(model_name="tiny", api_key=key)
    from click.testing import CliRunner

    from gpt2edge.cli import main

    result = CliRunner().invoke(main, ["serve", str(tiny_export), "--api-key", key])
    assert result.exit_code != 0 and "--api-key must be ASCII" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_an_ascii_key_matches_its_bytes_and_latin1_lookalikes_do_not(tiny_export):
    with running(tiny_export, api_key="k3y") as (url, _):
        body = {"prompt": "a", "max_tokens": 1}
        ok = httpx.post(url + "/v1/completions", json=body, headers={"authorization": "Bearer k3y"})
        # a header of raw latin-1 bytes: never equal to an ASCII key, and never a 500
        odd = httpx.post(url + "/v1/completions", json=body, headers=[(b"authorization", b"Bearer k3y\xe9")])
    assert ok.status_code == 200 and odd.status_code == 401


# ---- request fields: each refused under its own name, with a reason -------------------------------------------

BAD_FIELDS = {
    "Arabic-Indic digit": ({"logit_bias": {"٥": 1}}, "logit_bias", "ASCII digits"),
    "fullwidth digit": ({"logit_bias": {"５": 1}}, "logit_bias", "ASCII digits"),
    "Devanagari digits": ({"logit_bias": {"१२": 1}}, "logit_bias", "ASCII digits"),
    "superscript digit": ({"logit_bias": {"²": 1}}, "logit_bias", "ASCII digits"),
    "plus sign": ({"logit_bias": {"+5": 1}}, "logit_bias", "ASCII digits"),
    "minus sign": ({"logit_bias": {"-5": 1}}, "logit_bias", "ASCII digits"),
    "leading space": ({"logit_bias": {" 5": 1}}, "logit_bias", "ASCII digits"),
    "trailing newline": ({"logit_bias": {"5\n": 1}}, "logit_bias", "ASCII digits"),
    "underscore": ({"logit_bias": {"1_0": 1}}, "logit_bias", "ASCII digits"),
    "5 and 05": ({"logit_bias": {"5": 1, "05": -1}}, "logit_bias", "leading zero"),
    "00": ({"logit_bias": {"00": 1}}, "logit_bias", "leading zero"),
    "huge stop_token_ids": ({"stop_token_ids": [10**30]}, "stop_token_ids", "outside the vocabulary"),
    "negative stop_token_ids": ({"stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_token_id_fields_take_ascii_canonical_ids_only(server, case):
    fields, param, words = BAD_FIELDS[case]
    err = error_of(post(server[0], {"prompt": "a", "max_tokens": 2, **fields}))
    assert err["param"] == param and words in err["message"]
    assert "keys" not in err["message"] or param == "logit_bias"


def test_valid_ids_still_work(server):
    r = post(server[0], {"prompt": "a", "max_tokens": 2, "logit_bias": {"0": 1, "10": -1}, "stop_token_ids": [0]})
    assert r.status_code == 200, r.text


def test_tokenize_takes_one_string_and_refuses_unknown_fields(server):
    url = server[0]
    for body, param in [({"prompt": ["a"]}, "prompt"), ({"content": ["a", "b"]}, "content"),
                        ({"prompt": "a", "max_tokens": 3}, "max_tokens")]:  # fmt: skip
        err = error_of(httpx.post(url + "/tokenize", json=body))
        assert err["param"] == param
        assert "list of strings" not in err["message"]
    assert "one string" in error_of(httpx.post(url + "/tokenize", json={"prompt": ["a"]}))["message"]
    assert "max_tokens" in error_of(httpx.post(url + "/tokenize", json={"prompt": "a", "max_tokens": 3}))["message"]


@pytest.mark.parametrize("extra", ["tool_calls", "tool_call_id", "refusal"])
def test_an_unknown_message_field_lists_what_messages_accept(server, extra):
    messages = [{"role": "assistant", "content": "x", extra: []}]
    err = error_of(httpx.post(server[0] + "/v1/chat/completions", json={"messages": messages}))
    assert err["param"] == f"messages.0.{extra}" and err["code"] == "unknown_field"
    assert "accepts: role, content, name." in err["message"]


def test_chat_top_logprobs_goes_to_20_and_is_refused_under_its_own_name(server):
    url = server[0]
    body = {"messages": USER, "max_tokens": 2, "logprobs": True, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json={**body, "top_logprobs": 20}, timeout=60)
    assert r.status_code == 200, r.text
    assert all(len(c["top_logprobs"]) == 20 for c in r.json()["choices"][0]["logprobs"]["content"])
    for bad in (21, 100, -1):
        err = error_of(httpx.post(url + "/v1/chat/completions", json={**body, "top_logprobs": bad}))
        assert err["param"] == "top_logprobs", err
    # the legacy completions endpoint keeps OpenAI's cap of 5 for `logprobs`
    assert error_of(post(url, {"prompt": "a", "logprobs": 6}))["param"] == "logprobs"

