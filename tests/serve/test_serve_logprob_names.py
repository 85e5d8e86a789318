"""OpenAI's legacy logprobs key top_logprobs by token text: tokens that have no text of their own (ids past the
tokenizer's vocabulary, as in a vocabulary padded for speed or a random checkpoint's 50,257 rows over a small
trained tokenizer) must keep distinct names, so that no entry hides another and the chosen token's own
log-prob is the one listed under its name."""

from __future__ import annotations

from gpt2edge.runtime.decoding.logprobs import TokenLogprob, TopLogprob
from gpt2edge.serve.scheduling.logprobs import ChoiceLogprobs, logprobs_body, token_entry


class NoText:
    """A tokenizer that knows ids below 10 only (each is the letter a..j); others decode to nothing."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids if i < 10)


def record(token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
    def raw(i):
        return [ord("a") + i] if i < 10 else []  # what the runtime records for an id the tokenizer lacks

    tops = [TopLogprob(i, bytes(raw(i)).decode(), lp, raw(i)) for i, lp in top]
    return TokenLogprob(token_id, bytes(raw(token_id)).decode(), logprob, raw(token_id), tops)


def test_tokens_without_text_keep_distinct_names_in_top_logprobs():
    r = record(52, -3.0, [(50, -1.0), (51, -2.0), (52, -3.0), (1, -4.0)])
    entry = token_entry(r, 4, offset=0, renders=False)
    assert len(entry.top) == 4  # none hidden by another of the same (empty) name
    assert entry.top[entry.token] == -3.0  # the chosen token's own log-prob under its own name
    assert entry.top["b"] == -4.0 and len({entry.token, *entry.top}) == 4
    assert token_entry(record(50, -1.0, []), 0, 0, False).token != token_entry(record(51, -1.0, []), 0, 0, False).token


def test_a_choice_with_textless_tokens_reports_each_one():
    lp = ChoiceLogprobs(NoText(), 2, prompt_chars=3)
    for r in (record(0, -1.0, [(0, -1.0), (50, -2.0)]), record(50, -2.5, [(51, -1.5), (50, -2.5)]),
              record(1, -0.5, [(1, -0.5), (52, -0.7)])):  # fmt: skip
        lp.push(r)
    body = logprobs_body(lp.finish(2), 2)  # the text is "ab"
    assert len(body["tokens"]) == 3 and len(set(body["tokens"])) == 3
    assert body["text_offset"] == [3, 4, 4]  # the textless token sits where the next character starts
    assert [top[t] for t, top in zip(body["tokens"], body["top_logprobs"])] == body["token_logprobs"]
    assert all(len(top) == 2 for top in body["top_logprobs"])
