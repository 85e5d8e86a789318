"""The new processors end to end through Generator: greedy equals transformers' generate with the same options."""

from __future__ import annotations

import pytest
import torch

from gpt2edge.errors import GenerationError
from gpt2edge.runtime import Generator

PROMPT = "The river rose and the"


@pytest.fixture(scope="module", params=["tiny_export", "tiny_export_shared"])
def gen(request) -> Generator:
    return Generator(request.getfixturevalue(request.param))


def hf_greedy(hf_model, ids: list[int], n: int, **kw) -> list[int]:
    out = hf_model.generate(
        input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw
    )
    return out[0, len(ids) :].tolist()


# (the repetition penalty is left out: it acts on the graph's log-probs where transformers' acts on raw logits,
# so generate() differs by design; the processor itself is tested against transformers' on the same scores)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_equals_transformers(gen, hf_model, n):
    kw = dict(no_repeat_ngram_size=n)
    # these read the generated ids too, not only the prompt: a loop that forgets to record them would differ
    r = gen.generate(PROMPT, max_new_tokens=40, min_new_tokens=40, do_sample=False, **kw)
    assert r.token_ids == hf_greedy(hf_model, r.prompt_token_ids, 40, **kw)
    seq = r.prompt_token_ids + r.token_ids
    grams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]
    assert len(grams) == len(set(grams))


def test_bad_words_equal_transformers_and_ban_strings(gen, hf_model):
    plain = gen.generate(PROMPT, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    # ban the first greedy token, and a two-token sequence the plain output contains
    bad = [[plain.token_ids[0]], plain.token_ids[3:5]]
    r = gen.generate(PROMPT, max_new_tokens=24, min_new_tokens=24, do_sample=False, bad_words_ids=bad)
    assert r.token_ids == hf_greedy(hf_model, r.prompt_token_ids, 24, bad_words_ids=bad)
    assert r.token_ids[0] != plain.token_ids[0]
    # --ban takes text: the string's tokens, with and without a leading space
    word = gen.tokenizer.decode(plain.token_ids[:1]).strip() or "the"
    banned = gen.ban_ids(word)
    assert tuple(gen.tokenizer.encode(word)) in banned and tuple(gen.tokenizer.encode(" " + word)) in banned
    r = gen.generate(PROMPT, max_new_tokens=24, do_sample=False, ban=word, ignore_eos=True)
    seq = r.token_ids
    for ids in banned:
        assert not any(tuple(seq[i : i + len(ids)]) == ids for i in range(len(seq)))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(bad_words_ids=[[10**6]]), "vocab"),
        (dict(ban=""), "non-empty"),
        (dict(min_p=0.0), "min_p"),
        (dict(typical_p=1.5), "typical_p"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    ],
)
def test_bad_processor_options_fail_before_work(gen, kw, match):
    with pytest.raises(GenerationError, match=match):
        gen.generate(PROMPT, max_new_tokens=4, **kw)


def test_min_p_and_typical_p_turn_sampling_on(gen):
    assert gen.sampling_params(min_p=0.1).do_sample and gen.sampling_params(typical_p=0.9).do_sample
    assert not gen.sampling_params(min_p=0.1, do_sample=False).do_sample
