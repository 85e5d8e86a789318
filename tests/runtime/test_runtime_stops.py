"""Stop strings split over many byte-level tokens, and streaming decode, with the real GPT-2 tokenizer.

A tiny random model with GPT-2's vocabulary runs the real generate loop; the sampler is replaced by a script
that emits the token ids of a chosen text, so generate() and stream() both see e.g. "नमस्ते" arrive as 12
tokens, none of which decodes to a whole character on its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpt2edge.runtime.decoding.generate as generate_module
import gpt2edge.runtime.decoding.row_decoder as row_decoder_module
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.tokenizer import StreamDecoder, TextTokenizer

GPT2_TOKENIZER = Path("/work/shared/gpt2-tokenizer")
pytestmark = pytest.mark.skipif(not (GPT2_TOKENIZER / "vocab.json").is_file(), reason="GPT-2 tokenizer files absent")


@pytest.fixture(scope="module")
def gpt2_vocab_export(tmp_path_factory) -> Path:
    from gpt2edge.export import export_model, make_random_checkpoint

    root = tmp_path_factory.mktemp("gpt2vocab")
    ckpt = make_random_checkpoint(root / "ckpt", size="tiny", seed=0, tokenizer_dir=str(GPT2_TOKENIZER))
    export_model(str(ckpt), root / "export")
    return root / "export"


@pytest.fixture(scope="module")
def gen(gpt2_vocab_export) -> Generator:
    return Generator(gpt2_vocab_export)


@pytest.fixture
def script(gen, monkeypatch):
    """script(text) makes every row's sampler emit the token ids of `text`, in order; returns those ids."""

    def install(text: str) -> list[int]:
        ids = gen.tokenizer.encode(text)

        def scripted(scores, params, seen, n_generated, rng, columns=None, allowed=None):
            return np.full(len(scores), ids[n_generated], dtype=np.int64)

        monkeypatch.setattr(row_decoder_module, "next_tokens", scripted)
        return ids

    return install


def both_paths(gen: Generator, n: int, stop):
    kw = dict(max_new_tokens=n, ignore_eos=True, stop=stop)
    result: list = []
    streamed = list(gen.stream("Say:", result=result, **kw))
    return gen.generate("Say:", **kw), streamed, result[0]


@pytest.mark.parametrize(
    "before, stop, after",
    [
        ("Hello, ", "नमस्ते", " and more text after it"),
        ("Birds: ", "🦜🦜🦜", " fly away"),
        ("Hi नमस् there ", "नमस्ते", " end"),  # a false start (a prefix of the stop string) first
        ("🦜🦜 then ", "🦜🦜🦜", "🦜 more"),  # overlapping candidates
        ("The end of the ", "line", " is near"),  # a plain ASCII stop string as a control
    ],
)
def test_stop_string_over_many_tokens_ends_both_paths_the_same_way(gen, script, before, stop, after):
    ids = script(before + stop + after)
    n_stop = len(gen.tokenizer.encode(stop))
    if not stop.isascii():
        assert n_stop >= 9  # "नमस्ते": 12 tokens, "🦜🦜🦜": 9
    r, pieces, streamed = both_paths(gen, len(ids), [stop])
    assert r.finish_reason == "stop" and r.text == before
    assert len(r.token_ids) < len(ids)  # generation ended at the stop string, not at max_new_tokens
    assert "".join(pieces) == before  # the stop string (and anything after it) was never printed
    assert not any("\ufffd" in p for p in pieces)
    assert streamed.finish_reason == "stop" and streamed.text == r.text and streamed.token_ids == r.token_ids


def test_plain_string_stop_is_one_stop_string(gen, script):
    ids = script("Hello wide world, we wait")
    r, pieces, _ = both_paths(gen, len(ids), "world")  # not the stops "w", "o", "r", "l", "d"
    assert r.finish_reason == "stop" and r.text == "Hello wide " == "".join(pieces)


def test_loop_treats_a_plain_string_as_one_stop_string(gen, script):
    """The generate loop itself (bench, quality and other callers build SamplingParams directly)."""
    from gpt2edge.runtime import SamplingParams

    ids = script("Hello wide world, we wait")
    params = SamplingParams(max_new_tokens=len(ids), stop="world")
    state = generate_module.generate(gen.lm, gen.tokenizer, [gen.tokenizer.encode("Say:")], params, pad_id=0)
    assert state.finish_reasons == ["stop"] and state.texts[0].text == "Hello wide "


def test_without_a_stop_both_paths_give_the_whole_text(gen, script):
    text = "Emoji 🦜 and नमस्ते and 今天天气不错, done"
    ids = script(text)
    r, pieces, streamed = both_paths(gen, len(ids), None)
    assert r.finish_reason == "length" and r.text == text == "".join(pieces) == streamed.text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_matches_decode_on_arbitrary_ids(gen):
    """Random ids (many of them lone bytes of multi-byte characters): the pieces plus flush() are decode()."""
    tok: TextTokenizer = gen.tokenizer
    rng = np.random.default_rng(0)
    for trial in range(40):
        high = 256 if trial % 2 else 50257  # ids < 256 are GPT-2's single-byte tokens
        ids = rng.integers(0, high, 50).tolist()
        dec = StreamDecoder(tok)
        pieces = [dec.push(i) for i in ids]
        assert "".join(pieces) + dec.flush() == tok.decode(ids)
        assert not any(p.endswith("\ufffd") for p in pieces)  # a piece never ends inside a character
