"""Presence/frequency penalties, logit_bias and stop_token_ids act in the runtime (runtime/decoding/row_penalties.py):
Generator.generate and the continuous server's /v1/completions give the same text for the same request."""

import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed (serve extra)")

from gpt2edge.errors import GenerationError  # noqa: E402
from gpt2edge.runtime import Generator  # noqa: E402
from tests.support.serve import PROMPTS, post, running  # noqa: E402


@pytest.mark.parametrize("scheduler", ["continuous", "next-batch"])
def test_api_and_server_agree_on_penalties_bias_and_stops(tiny_export, scheduler):
    """Both schedulers drive the runtime's RowDecoder: every field gives the Generator's text and finish reason."""
    gen = Generator(tiny_export)
    plain = gen.generate(PROMPTS[3], max_new_tokens=10, ignore_eos=True, do_sample=False, top_k=0).token_ids
    stop = plain[4]
    text = gen.tokenizer.decode(plain)
    requests = [  # (server fields, Generator keywords): greedy and seeded, penalties, a forced/banned token, a stop
        ({"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.7}, {"do_sample": False}),
        ({"temperature": 0, "logit_bias": {str(plain[0] + 1): 100}}, {"do_sample": False}),
        ({"temperature": 0, "logit_bias": {str(plain[0]): -100}, "stop_token_ids": [stop]}, {"do_sample": False}),
        (
            {"temperature": 0.9, "seed": 7, "frequency_penalty": 1.0, "logit_bias": {str(plain[1]): -100}},
            {"do_sample": True, "temperature": 0.9, "seed": 7, "top_p": 1.0},
        ),  # fmt: skip
        ({"temperature": 0.8, "seed": 3, "presence_penalty": 0.5, "stop": [text[3:6]]},
         {"do_sample": True, "temperature": 0.8, "seed": 3, "top_p": 1.0}),  # fmt: skip
        ({"temperature": 0, "stop_token_ids": [stop]}, {"do_sample": False}),
    ]
    with running(tiny_export, scheduler=scheduler) as (url, _):
        for fields, kw in requests:
            body = {"prompt": PROMPTS[3], "max_tokens": 10, "ignore_eos": True, **fields}
            served = post(url, body).json()["choices"][0]
            names = ("presence_penalty", "frequency_penalty", "stop_token_ids", "stop")
            api_kw = {k: fields[k] for k in names if k in fields}
            if "logit_bias" in fields:
                api_kw["logit_bias"] = {int(t): b for t, b in fields["logit_bias"].items()}
            out = gen.generate(PROMPTS[3], max_new_tokens=10, ignore_eos=True, top_k=0, folder_defaults=False,
                               **kw, **api_kw)  # fmt: skip
            assert served["text"] == out.text, fields
            reason = {"eos": "stop"}.get(out.finish_reason, out.finish_reason)
            assert served["finish_reason"] == reason, fields
    assert out.finish_reason == "eos" and out.text == gen.tokenizer.decode(plain[:4])  # the stop token ends it


def test_penalty_ranges_are_checked(tiny_export):
    gen = Generator(tiny_export)
    for kw, word in (({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {1: 101}}, "logit_bias"),
                     ({"stop_token_ids": [10**6]}, "stop_token_ids")):  # fmt: skip
        with pytest.raises(GenerationError, match=word):
            gen.generate("A", max_new_tokens=2, **kw)


def test_cli_gives_the_apis_tokens(tiny_export):
    import json

    from click.testing import CliRunner

    from gpt2edge.cli import main

    gen = Generator(tiny_export)
    plain = gen.generate(PROMPTS[3], max_new_tokens=8, ignore_eos=True, do_sample=False, top_k=0).token_ids
    flags = ["--presence-penalty", "1.5", "--frequency-penalty", "0.5", "--logit-bias", f"{plain[0]}=-100",
             "--stop-token-id", str(plain[3])]  # fmt: skip
    # greedy, and seeded sampling (--do-sample: the tiny folder's generation_config.json says greedy)
    seeded = (["--do-sample", "-s", "7", "--temperature", "0.9"], {"do_sample": True, "seed": 7, "temperature": 0.9})
    for mode, kw in ((["--greedy"], {"do_sample": False}), seeded):
        args = ["generate", str(tiny_export), "-p", PROMPTS[3], "-n", "8", "--ignore-eos", "--top-k", "0", "--json"]
        res = CliRunner().invoke(main, args + mode + flags)
        assert res.exit_code == 0, res.output
        row = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={plain[0]: -100}, stop_token_ids=[plain[3]])
        out = gen.generate(PROMPTS[3], max_new_tokens=8, ignore_eos=True, top_k=0, **row, **kw)
        got = json.loads(res.output[res.output.index("{") :])
        assert got["token_ids"] == out.token_ids and got["text"] == out.text, (mode, got)
    bad = CliRunner().invoke(main, ["generate", str(tiny_export), "-p", "A", "--logit-bias", "1=500"])
    assert bad.exit_code == 2 and "[-100, 100]" in bad.output and "Traceback" not in bad.output


def test_beam_search_refuses_them(tiny_export):
    with pytest.raises(GenerationError, match="Beam search does not take"):
        Generator(tiny_export).generate("A", max_new_tokens=2, num_beams=2, do_sample=False, presence_penalty=1)
