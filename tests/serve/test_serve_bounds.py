"""What an outside attack found past the first hardening round: request fields read too loosely (Unicode digits as
token ids, a field's error under another's name), a key that can never match, and work with no bound on the
event loop (chat templates that amplify their input, tokenizing a prompt far over the context), HTTP heads that
slip past the header cap or frame their body twice, and streams cut at shutdown without an error event."""

from __future__ import annotations

import asyncio
import re
import shutil
import threading

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")

from gpt2edge.errors import ServeError  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.api.protocol import ApiError  # noqa: E402
from tests.support.serve import post, running  # noqa: E402

# one template, many behaviours: the last message's content picks a way to amplify or to fail
TEMPLATE = """{% set last = messages[-1].content %}
{% if last == 'amplify' %}{% for m in messages %}{% for i in range(m.content|int) %}x{% endfor %}{% endfor %}
{% elif last == 'nested' %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}
{% elif last == 'multiply' %}{{ 'x' * 10**9 }}
{% elif last == 'center' %}{{ last|center(10**8) }}
{% elif last == 'indent' %}{{ 'a\nb\nc'|indent(10**8) }}
{% elif last == 'join' %}{{ messages|map(attribute='content')|join('x' * 10**6) }}
{% elif last == 'format' %}{{ '{:>999999999}'.format('x') }}
{% elif last == 'double' %}{% set ns = namespace(s='xy') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}\
{% endfor %}{{ ns.s|length }}
{% elif last == 'recurse' %}{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}
{% elif last == 'range' %}{{ range(10**9)|length }}
{% elif last == 'include' %}{% include 'other.jinja' %}
{% elif last == 'raise' %}{{ raise_exception('roles must alternate') }}
{% elif last == 'surrogate' %}{{ '\\ud800' }}
{% else %}{% for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}{% endif %}assistant:"""
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def chat_folder(tiny_export, tmp_path_factory):
    out = tmp_path_factory.mktemp("bounds") / "tiny-chat"
    shutil.copytree(tiny_export, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def server(chat_folder):
    with running(chat_folder, max_batch=8, template_timeout_s=3.0) as (url, scheduler):
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


# ---- chat templates: bounded, off the event loop, every failure a 400 ------------------------------------------

BOUND = "renders more than|more than 512 MiB"
TEMPLATE_CASES = {
    # BOUND: its output cut at the byte limit, or its memory budget, whichever comes first
    # the attack's own: 1,024 messages of "99999" looped over, 50 KB of body
    "amplify": ([{"role": "user", "content": "99999"}] * 1023, "template_limit", BOUND),
    "nested": ([], "template_limit", "ran past its 3 s"),
    "multiply": ([], "template_limit", BOUND),
    "center": ([], "template_limit", BOUND),
    "indent": ([], "template_limit", BOUND),
    "join": ([{"role": "user", "content": "a"}] * 1023, "template_limit", BOUND),
    "format": ([], "template_limit", BOUND),
    "double": ([], "template_limit", BOUND),
    "recurse": ([], "template_error", "recursed too deep"),
    "range": ([], "template_error", "OverflowError"),
    "include": ([], "template_error", "loader"),
    "raise": ([], "template_error", "roles must alternate"),
    "surrogate": ([], "template_error", "invalid Unicode"),  # a jinja literal's escape: a lone surrogate
}


@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
def test_an_amplifying_or_failing_template_is_a_400_that_says_why(server, case):
    before, code, words = TEMPLATE_CASES[case]
    messages = [*before, {"role": "user", "content": case}]
    r = httpx.post(server[0] + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)
    err = error_of(r)
    assert (err["code"], err["param"]) == (code, "messages") and re.search(words, err["message"]), err
    # the sandbox lives on: the next render is an ordinary one
    ok = httpx.post(server[0] + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_slow_render_leaves_the_event_loop_free(server):
    """While a template grinds through 10**10 loop turns (the worker stops it at its deadline), /health
    answers: it comes back first."""

    async def race(url):
        order = []
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def chat():
                r = await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "nested"}]}
                )
                order.append(("chat", r.status_code))

            async def health():
                await asyncio.sleep(0.2)  # the render is under way
                r = await client.get("/health")
                order.append(("health", r.status_code))

            await asyncio.gather(chat(), health())
        return order

    assert asyncio.run(race(server[0])) == [("health", 200), ("chat", 400)]


def test_a_render_stuck_in_one_c_call_is_killed_and_the_sandbox_respawns():
    """`10 ** (10 ** 9)` never reaches a bytecode boundary for the interrupt: the process is ended and replaced."""
    from gpt2edge.serve.api.chat_template import ChatTemplate, TemplateSandbox

    sandbox = TemplateSandbox(timeout_s=0.5)
    try:
        with pytest.raises(ApiError, match="exhausted its process") as e:
            sandbox.render(ChatTemplate("{{ (10 ** (10 ** 9)) > 1 }}", {}), USER, 1 << 16)
        assert e.value.status == 400 and e.value.code == "template_limit"
        assert sandbox.render(ChatTemplate("{{ messages[0].content }}!", {}), USER, 1 << 16) == "Hello there!"
    finally:
        sandbox.close()


# ---- tokenizing: far-over prompts refused from their bytes, the rest off the event loop ------------------------


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(server, monkeypatch):
    url, scheduler = server
    calls = []
    encode = scheduler.encode
    monkeypatch.setattr(scheduler, "encode", lambda text: calls.append(len(text)) or encode(text))
    big = "The weather today " * 20_000  # 360 KB: a token covers at most max_token_bytes of it
    for body in ({"prompt": big}, {"prompt": ["a", big]}, {"prompt": "a" * 5000, "max_tokens": 1}):
        err = error_of(post(url, body))
        assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]}, timeout=60)
    assert error_of(chat)["code"] in ("context_length_exceeded", "template_limit")
    assert calls == []  # the tokenizer never saw them
    assert post(url, {"prompt": "a", "max_tokens": 1}).status_code == 200 and calls == [1]


def test_tokenize_runs_off_the_event_loop(server, monkeypatch):
    """A tokenizer busy with a long text (held here until /health has answered) stalls nobody else."""
    url, scheduler = server
    answered = threading.Event()
    encode = scheduler.tokenizer.encode

    def slow_encode(text):
        answered.wait(20)  # on the event loop this would hold /health back, and the order below would flip
        return encode(text)

    monkeypatch.setattr(scheduler.tokenizer, "encode", slow_encode)

    async def race():
        order = []
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def tokenize():
                r = await client.post("/tokenize", json={"prompt": "a b c"})
                order.append(("tokenize", r.status_code))

            async def health():
                await asyncio.sleep(0.2)
                r = await client.get("/health")
                order.append(("health", r.status_code))
                answered.set()

            await asyncio.gather(tokenize(), health())
        return order

    assert asyncio.run(race()) == [("health", 200), ("tokenize", 200)]


# ---- HTTP heads: capped however they arrive, one body framing only ---------------------------------------------


def _raw(url: str, pieces: list[bytes]) -> bytes:
    from tests.support.serve import connect, read_all

    s = connect(url)
    try:
        for piece in pieces:
            s.sendall(piece)
    except (BrokenPipeError, ConnectionResetError) as e:  # the server closed before reading it all: a reset
        raise AssertionError(f"the server reset the connection mid-request ({e})") from None
    answer = read_all(s)
    s.close()
    return answer


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
BODY = b'{"prompt": "a", "max_tokens": 1}'


@pytest.fixture(scope="module")
def small_heads(tiny_export):
    with running(tiny_export, max_header_bytes=2048) as (url, _):
        yield url


@pytest.mark.parametrize(
    "pieces",
    [
        [HEAD + b"x-big: " + b"a" * 60_000 + b"\r\n\r\n"],  # one piece, 30 times the cap
        [HEAD + b"x-big: " + b"a" * (1 << 20) + b"\r\n\r\n"],  # a megabyte: answered, not reset
        [HEAD + b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 40) for i in range(60)) + b"\r\n"],  # many small headers
        [HEAD + b"x-big: " + b"a" * 1500, b"a" * 1500 + b"\r\n\r\n"],  # split: the cap counts both pieces
        [HEAD + b"x-big: " + b"a" * 4000],  # never finished
        [b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" + b"GET /health HTTP/1.1\r\nx: " + b"a" * 4000 + b"\r\n\r\n"],
    ],
    ids=["60KB-one-piece", "1MB-one-piece", "many-headers", "split", "unfinished", "pipelined-second"],
)
def test_a_head_over_the_cap_gets_431_however_it_arrives(small_heads, pieces):
    answer = _raw(small_heads, pieces)
    assert b"HTTP/1.1 431 " in answer and b"--max-header-kb" in answer, answer[:300]
    assert post(small_heads, {"prompt": "a", "max_tokens": 1}).status_code == 200


def test_a_head_under_the_cap_is_served(small_heads):
    head = HEAD + b"x-fill: " + b"a" * 1500 + b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(BODY)
    assert _raw(small_heads, [head + BODY]).startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(
    "framing",
    [
        b"content-length: 5\r\ntransfer-encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 33\r\n",
        b"TRANSFER-ENCODING: chunked\r\nCONTENT-LENGTH: 0\r\n",
        b"content-length: 33\r\ntransfer-encoding: gzip, chunked\r\n",
    ],
)
def test_content_length_with_transfer_encoding_is_refused(small_heads, framing):
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    answer = _raw(small_heads, [HEAD + framing + b"\r\n" + chunked])
    assert answer.startswith(b"HTTP/1.1 400 ") and b"HTTP/1.1 200" not in answer, answer[:300]
    assert b"RFC 9112" in answer or b"gzip" in framing  # h11 itself refuses a coding it does not speak
    # chunked alone is an ordinary request
    plain = HEAD + b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n" + chunked
    assert _raw(small_heads, [plain]).startswith(b"HTTP/1.1 200 ")


# ---- shutdown: streams past --shutdown-timeout end with an error event, not a cut ----------------------------


def test_streams_past_the_shutdown_timeout_end_with_an_error_event(tiny_export, capfd, monkeypatch):
    from gpt2edge.runtime import Generator
    from gpt2edge.serve.api.app import create_app
    from gpt2edge.serve.hosting import server as hosting
    from gpt2edge.serve.hosting.server import BackgroundServer
    from tests.support.serve import SlowContinuous, parse_sse

    # a loaded host may need more than the default 2 s for four streams to send their error event and close
    # before uvicorn cancels them: the error events come at the shutdown timeout either way
    monkeypatch.setattr(hosting, "ABORT_S", 8.0)

    config = ServeConfig(model_name="tiny", shutdown_timeout_s=0.3)
    scheduler = SlowContinuous(Generator(tiny_export), config)
    scheduler.delay = 0.05  # 100 tokens: 5 s a stream, far past the 0.3 s the shutdown allows
    server = BackgroundServer(create_app(lambda: scheduler, config))
    url = server.__enter__()
    started = [threading.Event() for _ in range(4)]
    events: list[list] = [[] for _ in started]

    def stream(i: int) -> None:
        body = {"prompt": "a", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                events[i] += parse_sse([line])
                started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(started))]
    for t in threads:
        t.start()
    try:
        assert all(s.wait(30) for s in started)
    finally:
        server.stop()  # what SIGTERM does
        server.__exit__(None, None, None)
        for t in threads:
            t.join(30)
    for got in events:
        assert "[DONE]" not in got and got[-1]["error"]["code"] == "shutting_down", got[-1]
        assert any(e.get("choices") for e in got[:-1])  # text went out before the shutdown
    err = capfd.readouterr().err
    assert "CancelledError" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("prompt", ["\ud800", "a\udfff b", ["ok", "\udbff"]])
def test_a_prompt_with_a_lone_surrogate_is_a_400(server, prompt):
    err = error_of(post(server[0], {"prompt": prompt, "max_tokens": 2}))
    assert re.search("surrogate|Unicode|UTF-8", err["message"]), err
