"""Inputs at the edge of what the types allow: a temperature so small that every score overflows, and text
that is a Python str but not valid Unicode (lone surrogates: from argv's surrogateescape or a JSON "\\ud800")."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.errors import GenerationError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.decoding.sampling import SamplingParams, warp_row


@pytest.mark.parametrize("t", [1e-45, 1e-40, 1e-30])
def test_a_tiny_temperature_is_the_greedy_limit_not_an_error(t):
    row = np.log(np.array([0.1, 0.6, 0.3], dtype=np.float32))
    ids, probs = warp_row(row, SamplingParams(do_sample=True, temperature=t, top_k=0))
    assert ids[probs.argmax()] == 1 and probs.max() == pytest.approx(1.0)


def test_generate_with_a_subnormal_temperature_equals_greedy(tiny_export):
    g = Generator(tiny_export)
    greedy = g.generate("The river", max_new_tokens=6, do_sample=False)
    tiny = g.generate("The river", max_new_tokens=6, do_sample=True, temperature=1e-45, seed=0)
    assert tiny.token_ids == greedy.token_ids


@pytest.mark.parametrize("where", ["prompt", "stop", "ban"])
def test_lone_surrogates_are_a_one_line_error(tiny_export, where):
    g = Generator(tiny_export)
    kw = {"prompt": "caf\udcff"} if where == "prompt" else {"prompt": "hi", where: ["x\ud800"]}
    with pytest.raises(GenerationError, match="Unicode"):
        g.generate(kw.pop("prompt"), max_new_tokens=2, **kw)


@pytest.mark.parametrize("flag", ["--stop", "--ban"])
def test_cli_non_utf8_stop_or_ban_is_a_one_line_error(tiny_export, flag):
    out = CliRunner().invoke(main, ["generate", str(tiny_export), "-p", "hi", "-n", "2", flag, "x\udcff"])
    assert out.exit_code == 1 and out.output.startswith("error:") and "Traceback" not in out.output, out.output


@pytest.mark.parametrize(
    "body", [b'{"prompt": "\\ud800"}', b'{"prompt": ["ok", "a\\udfff"]}', b'{"prompt": "hi", "stop": ["\\ud83d"]}']
)
def test_serve_refuses_json_escaped_lone_surrogates_with_a_400(body):
    from gpt2edge.serve.api.protocol import ApiError, parse_request

    with pytest.raises(ApiError) as e:
        parse_request(body)
    assert e.value.status == 400 and e.value.code == "invalid_encoding" and "surrogate" in e.value.message
    assert parse_request(b'{"prompt": "caf\\u00e9 \\ud83d\\ude00"}').prompt == "caf\u00e9 \U0001f600"  # a pair is fine


def test_search_parameters_take_numpy_scalars_like_the_sampling_parameters(tiny_export):
    """SamplingParams takes np.int64 / np.float32; the beam search parameters refused them with "must be an
    integer >= 1, got 2"."""
    g = Generator(tiny_export)
    ref = g.generate("hi", max_new_tokens=3, num_beams=3, num_return_sequences=2, length_penalty=1.5)
    got = g.generate(
        "hi", max_new_tokens=np.int64(3), num_beams=np.int64(3), num_return_sequences=np.int32(2),
        length_penalty=np.float32(1.5),
    )  # fmt: skip
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    with pytest.raises(GenerationError, match="num_beams"):
        g.generate("hi", max_new_tokens=3, num_beams=True)  # a bool is not a width
