"""Per-token log-probs (logprobs=N, `generate --json --logprobs N`): parity with PyTorch's log_softmax of the same
checkpoint on both graph kinds, read before any sampling processor; shape, ordering, bytes and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import gpt2edge.runtime.decoding.row_decoder as row_decoder_module
from gpt2edge.cli import main
from gpt2edge.errors import GenerationError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.decoding.logprobs import LogprobRecorder, top_ids
from gpt2edge.runtime.model.tokenizer import TextTokenizer

GPT2_TOKENIZER = Path("/work/shared/gpt2-tokenizer")
# sampling with every processor on: the recorded values must still be the model's own distribution
PROCESSED = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.9, repetition_penalty=1.4, seed=5)


@pytest.fixture(scope="module", params=["concat", "shared"])
def gen(request) -> Generator:
    return Generator(request.getfixturevalue("tiny_export" if request.param == "concat" else "tiny_export_shared"))


def hf_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """(len(ids), V) log_softmax of the transformers model at every position of one unpadded sequence."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1).numpy()


def assert_matches_torch(hf_model, result, n: int) -> None:
    """Each generated token's log-prob and top-n equal log_softmax at the position that predicted it."""
    P = len(result.prompt_token_ids)
    ref = hf_logprobs(hf_model, result.prompt_token_ids + result.token_ids[:-1])[P - 1 :]  # row i predicts token i
    assert [r.token_id for r in result.logprobs] == result.token_ids
    for i, rec in enumerate(result.logprobs):
        assert rec.logprob == pytest.approx(ref[i, rec.token_id], abs=1e-4)
        assert len(rec.top_logprobs) == n
        got_ids = [t.token_id for t in rec.top_logprobs]
        want_ids = np.argsort(-ref[i], kind="stable")[:n]
        for g, w in zip(got_ids, want_ids):
            assert g == w or abs(ref[i, g] - ref[i, w]) < 1e-4  # the same token, or a tie
        for t in rec.top_logprobs:
            assert t.logprob == pytest.approx(ref[i, t.token_id], abs=1e-4)
        values = [t.logprob for t in rec.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_logprobs_equal_torch_log_softmax_before_processors(gen, hf_model):
    r = gen.generate("The river rose and", max_new_tokens=16, logprobs=5, ignore_eos=True, **PROCESSED)
    assert len(r.token_ids) == 16
    assert_matches_torch(hf_model, r, 5)


def test_logprobs_of_a_left_padded_batch_match_each_row_alone(gen, hf_model):
    prompts = ["Children learned to swim before they could read", "The city"]
    rs = gen.generate(prompts, max_new_tokens=10, logprobs=3, ignore_eos=True, do_sample=False)
    assert len(rs[0].prompt_token_ids) != len(rs[1].prompt_token_ids)
    for r in rs:
        assert_matches_torch(hf_model, r, 3)


def test_stream_records_the_same_logprobs(gen):
    kw = dict(max_new_tokens=8, logprobs=2, ignore_eos=True, **PROCESSED)
    result: list = []
    text = "".join(gen.stream("The weather", result=result, **kw))
    assert text == result[0].text
    assert result[0].logprobs == gen.generate("The weather", **kw).logprobs


def test_zero_means_the_chosen_token_only_and_vocab_size_means_all(gen):
    zero = gen.generate("The river", max_new_tokens=4, logprobs=0, ignore_eos=True)
    assert len(zero.logprobs) == 4 and all(r.top_logprobs == [] for r in zero.logprobs)
    V = gen.graph.vocab_size
    everything = gen.generate("The river", max_new_tokens=2, logprobs=V, ignore_eos=True)
    for rec in everything.logprobs:
        assert sorted(t.token_id for t in rec.top_logprobs) == list(range(V))
        assert np.exp([t.logprob for t in rec.top_logprobs]).sum() == pytest.approx(1.0, abs=1e-4)


def test_a_row_that_ends_early_has_one_record_per_token(gen, monkeypatch):
    """EOS at step 2 in row 0: its records stop there, including the EOS token's own log-prob."""
    eos = gen.eos_token_id[0]
    real = row_decoder_module.next_tokens

    def scripted(scores, params, seen, n_generated, rng, columns=None, allowed=None):
        tokens = real(scores, params, seen, n_generated, rng, columns)
        if n_generated == 2:
            tokens[0] = eos
        return tokens

    monkeypatch.setattr(row_decoder_module, "next_tokens", scripted)
    rs = gen.generate(["The river rose", "A"], max_new_tokens=6, logprobs=1, do_sample=False)
    assert rs[0].finish_reason == "eos" and rs[0].token_ids[-1] == eos and len(rs[0].logprobs) == 3
    assert rs[0].logprobs[-1].token == "<|endoftext|>" and rs[0].logprobs[-1].logprob < 0
    assert len(rs[1].logprobs) == len(rs[1].token_ids) == 6


def test_json_shape_and_absent_unless_asked(gen):
    plain = gen.generate("The river", max_new_tokens=3, ignore_eos=True).to_json()
    assert "logprobs" not in plain
    out = json.loads(json.dumps(gen.generate("The river", max_new_tokens=3, logprobs=2, ignore_eos=True).to_json()))
    rec = out["logprobs"][0]
    assert set(rec) == {"token_id", "token", "logprob", "bytes", "top_logprobs"}
    assert set(rec["top_logprobs"][0]) == {"token_id", "token", "logprob", "bytes"}
    assert [r["token_id"] for r in out["logprobs"]] == out["token_ids"]


@pytest.mark.parametrize("bad", [-1, 401, 1.5, True, "3"])
def test_bad_n_is_one_line_error_before_any_work(gen, bad):
    gen.generate("x", max_new_tokens=2)  # the primary context has run once
    before = gen.lm.past_len
    with pytest.raises(GenerationError, match=r"^logprobs must be an integer from 0 .* to 400 .*got") as e:
        gen.generate("The river rose", max_new_tokens=2, logprobs=bad)
    assert "\n" not in str(e.value) and gen.lm.past_len == before
    with pytest.raises(GenerationError):
        gen.stream("The river rose", logprobs=bad)  # raised at the call, before the first piece


def test_cli_json_logprobs_and_errors(tiny_export):
    runner = CliRunner()
    ok = runner.invoke(main, ["generate", str(tiny_export), "-p", "The river", "-n", "4", "--json", "--logprobs", "3"])
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.stdout)
    assert len(out["logprobs"]) == len(out["token_ids"]) and all(len(r["top_logprobs"]) == 3 for r in out["logprobs"])
    res = runner.invoke(main, ["generate", str(tiny_export), "-p", "x", "--json", "--logprobs", "401"])
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "error: logprobs must be an integer from 0 (the chosen token only) to 400 (the vocabulary size), got 401."
    ]
    negative = runner.invoke(main, ["generate", str(tiny_export), "-p", "x", "--json", "--logprobs", "-1"])
    assert negative.exit_code == 2 and "Invalid value for '--logprobs'" in negative.stderr  # click's range
    no_json = runner.invoke(main, ["generate", str(tiny_export), "-p", "x", "--logprobs", "2"])
    assert no_json.exit_code == 2 and "--logprobs needs --json" in no_json.stderr


def test_top_ids_orders_by_value_then_id_and_keeps_ties_fair():
    row = np.array([0.0, -1.0, -0.5, -0.5, -0.5, -3.0], dtype=np.float32)
    assert top_ids(row, 0).tolist() == []
    assert top_ids(row, 2).tolist() == [0, 2]  # of the three tied at -0.5, the smallest id
    assert top_ids(row, 4).tolist() == [0, 2, 3, 4]
    assert top_ids(row, 6).tolist() == [0, 2, 3, 4, 1, 5]
    rng = np.random.default_rng(0)
    big = rng.normal(size=5000).astype(np.float32)
    assert top_ids(big, 7).tolist() == np.argsort(-big, kind="stable")[:7].tolist()


@pytest.mark.skipif(not (GPT2_TOKENIZER / "vocab.json").is_file(), reason="GPT-2 tokenizer files absent")
def test_token_bytes_rebuild_text_split_inside_characters(tmp_path):
    """ "नमस्ते" and "🦜" are split inside characters by GPT-2's BPE: each piece's text is U+FFFD, yet the bytes of
    the tokens, joined, are exactly the text's UTF-8."""
    from transformers import GPT2TokenizerFast

    hf = GPT2TokenizerFast(str(GPT2_TOKENIZER / "vocab.json"), str(GPT2_TOKENIZER / "merges.txt"))
    hf.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer(tmp_path / "tokenizer.json")
    recorder = LogprobRecorder(tok, 0, 1)
    text = "Hi नमस्ते 🦜 café<|endoftext|>"
    ids = tok.encode(text)
    assert any(recorder.token(i)[0] == "\ufffd" for i in ids)
    assert b"".join(bytes(recorder.token(i)[1]) for i in ids) == text.encode()
