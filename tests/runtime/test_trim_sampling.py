"""Generation on a vocabulary-trimmed folder samples over its K columns: the parity grid against the path that
scattered every step to a (B, V) row first (still there behind the graph's private _full_vocab_steps flag),
mode by mode, through Generator, sessions and Scorer, on both KV caches; and no step builds a V-wide row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpt2edge.errors import ModelFolderError
from gpt2edge.runtime import Generator, ModelFolder
from gpt2edge.runtime.model.columns import Columns
from gpt2edge.runtime.model.lm import OrtLM
from gpt2edge.runtime.score import Scorer
from gpt2edge.trim.handler import trim_vocab

EOS = 0  # the tiny tokenizer's <|endoftext|>
PROMPTS = ["The river rose and the", "A city"]


def trimmed_folder(src, root):
    keep = np.unique([EOS, *np.random.default_rng(0).choice(np.arange(1, 400), 50, replace=False)])
    ids = root / "keep.json"
    ids.write_text(json.dumps([int(i) for i in keep]))
    trim_vocab(src, root / "trimmed", keep_ids=ids, report=False)
    return root / "trimmed"


@pytest.fixture(scope="module", params=["tiny_export", "tiny_export_shared"])
def gen(request, tmp_path_factory) -> Generator:
    folder = trimmed_folder(request.getfixturevalue(request.param), tmp_path_factory.mktemp("trim-sampling"))
    return Generator(folder)


def both(gen: Generator, call):
    """call(gen) on the K columns, then with every step scattered to (B, V) first (the pre-columns path)."""
    try:
        gen.graph._full_vocab_steps = False
        new = call(gen)
        gen.graph._full_vocab_steps = True
        old = call(gen)
    finally:
        gen.graph._full_vocab_steps = False
    return new, old


def flat(results) -> list:
    return results if isinstance(results, list) and not isinstance(results[0], list) else sum(results, [])


def assert_same(new, old) -> None:
    new, old = flat(new if isinstance(new, list) else [new]), flat(old if isinstance(old, list) else [old])
    assert [r.token_ids for r in new] == [r.token_ids for r in old]
    assert [(r.text, r.finish_reason) for r in new] == [(r.text, r.finish_reason) for r in old]
    for a, b in zip(new, old):
        if b.sequence_score is not None:
            assert abs(a.sequence_score - b.sequence_score) <= 1e-6
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id
            assert [t.token_id for t in x.top_logprobs] == [t.token_id for t in y.top_logprobs]
            assert abs(x.logprob - y.logprob) <= 1e-6
            assert all(abs(s.logprob - t.logprob) <= 1e-6 for s, t in zip(x.top_logprobs, y.top_logprobs))


MODES = {
    "greedy": dict(do_sample=False),
    "sample top-k": dict(temperature=0.9, seed=3),
    "sample whole row": dict(top_k=0, seed=4),
    "top-p": dict(top_k=0, top_p=0.8, temperature=0.7, seed=5),
    "top-k + top-p": dict(top_k=20, top_p=0.9, seed=6),
    "min-p": dict(top_k=0, min_p=0.05, seed=7),
    "typical-p": dict(top_k=0, typical_p=0.7, seed=8),
    "repetition penalty": dict(repetition_penalty=1.8, top_k=0, seed=9),
    "repetition penalty greedy": dict(do_sample=False, repetition_penalty=1.8),
    "no-repeat n-gram": dict(do_sample=False, no_repeat_ngram_size=2),
    "no-repeat n-gram sampled": dict(no_repeat_ngram_size=1, top_k=0, seed=10),
    "min new tokens": dict(min_new_tokens=12, top_k=0, temperature=1.5, seed=11),
}


@pytest.mark.parametrize("mode", MODES)
def test_generate_on_columns_equals_the_full_vocabulary_path(gen, mode):
    kw = dict(max_new_tokens=16, **MODES[mode])
    new, old = both(gen, lambda g: g.generate(PROMPTS, **kw))
    assert_same(new, old)
    assert all(set(r.token_ids) <= set(gen.lm.kept_ids.tolist()) for r in new)  # full ids, kept ones


def test_bad_words_with_kept_dropped_and_multi_token_ids(gen):
    free = gen.generate(PROMPTS[0], max_new_tokens=12, do_sample=False, ignore_eos=True).token_ids
    dropped = int(np.setdiff1d(np.arange(400), gen.lm.kept_ids)[0])
    bad = [[free[0]], [dropped], [free[2], free[3]], [dropped, free[5]]]
    for kw in (dict(do_sample=False), dict(top_k=0, seed=12), dict(top_k=30, seed=13)):
        new, old = both(gen, lambda g, kw=kw: g.generate(PROMPTS, max_new_tokens=12, bad_words_ids=bad, **kw))
        assert_same(new, old)
        assert all(free[0] not in r.token_ids for r in new)


@pytest.mark.parametrize("n", [0, 5, 400])
def test_logprobs_records_carry_full_ids(gen, n):
    for kw in (dict(do_sample=False), dict(top_k=0, seed=14)):
        new, old = both(gen, lambda g, kw=kw: g.generate(PROMPTS, max_new_tokens=8, logprobs=n, **kw))
        assert_same(new, old)
        kept = set(gen.lm.kept_ids.tolist())
        assert all(t.token_id in kept for r in new for x in r.logprobs for t in x.top_logprobs)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_beams=3, num_return_sequences=2, do_sample=False),
        dict(num_beams=4, length_penalty=0.6, no_repeat_ngram_size=2, do_sample=False, repetition_penalty=1.3),
        dict(num_beams=2, early_stopping=True, min_new_tokens=4, do_sample=False),
        dict(num_return_sequences=3, top_k=0, top_p=0.9, seed=15),
    ],
)
def test_beams_and_several_sequences_equal_the_full_vocabulary_path(gen, kw):
    new, old = both(gen, lambda g: g.generate(PROMPTS, max_new_tokens=10, **kw))
    assert_same(new, old)


def test_session_turns_and_streams_equal_the_full_vocabulary_path(gen):
    def turns(g):
        s = g.session()
        s.append(PROMPTS[0])
        first = s.generate(max_new_tokens=8, top_k=0, seed=16)
        s.append(" and then")
        result: list = []
        pieces = "".join(s.stream(max_new_tokens=8, do_sample=False, result=result))
        return [first, result[0]], pieces

    (new, new_text), (old, old_text) = both(gen, turns)
    assert_same(new, old)
    assert new_text == old_text == new[1].text


def test_score_reads_the_kept_columns(gen):
    folder = ModelFolder.open(gen.folder.path)
    ids = folder.kept_ids()[np.random.default_rng(1).integers(0, len(folder.kept_ids()), 24)].tolist()
    scorer = Scorer(folder)
    new = scorer.score_ids(ids)
    scorer._lm.graph._full_vocab_steps = True
    old = scorer.score_ids(ids)
    assert new.token_logprobs == old.token_logprobs and np.isfinite(new.log_likelihood)


def test_no_step_scatters_to_the_full_vocabulary(gen, monkeypatch):
    """The point of it: generation, beams, logprobs and sessions read the (B, K) columns; nothing builds (B, V)."""

    def refuse(*a, **k):
        raise AssertionError("a (B, V) row was built")

    monkeypatch.setattr(OrtLM, "to_full_vocab", refuse)
    monkeypatch.setattr(Columns, "full", refuse)
    gen.generate(PROMPTS, max_new_tokens=6, top_k=0, logprobs=3, seed=1)
    gen.generate(PROMPTS, max_new_tokens=6, num_beams=3, do_sample=False)
    s = gen.session()
    s.append(PROMPTS[0])
    s.generate(max_new_tokens=4)
    Scorer(ModelFolder.open(gen.folder.path)).score_ids(gen.lm.kept_ids[:8].tolist())


def test_a_trimmed_folder_is_never_a_speculative_target(gen):
    """Speculative decoding verifies drafts on a --head tail target, and trim-vocab trims --head last exports
    only, so its full-vocabulary path never meets a trimmed head (a trimmed draft needs a trimmed target)."""
    with pytest.raises(ModelFolderError, match="head tail"):
        Generator(gen.folder.path, prompt_lookup=2)
