"""SlotLM (gpt2edge.runtime.model.slots): rows join a running batch's cache, decode with it and leave; each row's
greedy tokens are exactly the ones it gets alone, on both graph kinds, through shifts, re-packs and growth."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2edge.errors import GenerationError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.slots import SlotLM

GREEDY = dict(min_new_tokens=0, top_k=0, repetition_penalty=1.0, do_sample=False, ignore_eos=True)
TEXTS = [
    "The river rose and",
    "A",
    "Children learned to swim before they could read, and the old harbour",
    "Snow fell on the quiet hills",
    "Über café",
    "The city",
]
# (step the request arrives at, prompt, tokens it decodes): a long one runs past 64 positions (growth) and the
# shared length past 128 (re-packs); a long prompt arrives after short rows (a shift); rows leave mid-batch
SCHEDULE = [(0, 0, 30), (0, 1, 100), (0, 3, 5), (3, 2, 12), (6, 4, 40), (6, 5, 3), (20, 2, 50), (45, 0, 70)]


# the shared length reaches the model's 128 positions while a long row still runs 2 slots in (not worth a
# re-pack), and newcomers arrive then: they must re-pack first (slot 128 does not exist)
EDGE_TEXTS = [" ".join(["the"] * 11), " ".join(["the"] * 9), "the the"]  # 12, 10 and 3 tokens
EDGE = [(0, 0, 1), (0, 1, 118), *[(s, 2, 4) for s in range(110, 120, 3)]]


def run(slot: SlotLM, gen: Generator, texts=TEXTS, schedule=SCHEDULE) -> dict[int, list[int]]:
    """Drive the schedule greedily; returns each request's tokens."""
    prompts = [gen.tokenizer.encode(t) or [gen.bos_token_id] for t in texts]
    out: dict[int, list[int]] = {}
    rows: list[int] = []  # request index of each live cache row
    pending: list[int] = []  # token each live row feeds next
    waiting = list(enumerate(schedule))
    step = 0
    while waiting or rows:
        joining = [(i, r) for i, r in waiting if r[0] <= step and len(rows) < slot.rows]
        joining = joining[: slot.free_rows]
        if joining:
            waiting = [w for w in waiting if w not in joining]
            lp = slot.join([prompts[r[1]] for _, r in joining], gen.pad_token_id)
            for (i, _), row in zip(joining, lp):
                out[i] = [int(row.argmax())]
                rows.append(i)
                pending.append(out[i][-1])
        for c in reversed(range(len(rows))):  # finished rows leave (the last one moves into the hole)
            i = rows[c]
            if len(out[i]) == schedule[i][2]:
                moved = slot.free(c)
                assert moved == (len(rows) - 1 if c != len(rows) - 1 else None)
                rows[c], pending[c] = rows[-1], pending[-1]
                rows.pop(), pending.pop()
        if rows:
            lp = slot.step(np.array(pending))
            for c, row in enumerate(lp):
                out[rows[c]].append(int(row.argmax()))
                pending[c] = out[rows[c]][-1]
        step += 1
    return out


@pytest.mark.parametrize("kind", ["tiny_export", "tiny_export_shared"])
def test_rows_joining_and_leaving_get_their_tokens_alone(kind, request):
    gen = Generator(request.getfixturevalue(kind))
    slot = SlotLM(gen.graph, rows=4)
    got = run(slot, gen)
    for i, (_, p, n) in enumerate(SCHEDULE):
        alone = gen.generate(TEXTS[p], max_new_tokens=n, **GREEDY).token_ids
        assert got[i] == alone, f"request {i} ({kind})"
    assert slot.live == 0 and slot.past_len == 0
    assert slot.allocations == 2  # 64 positions, then grown once to 128: never per request
    assert slot.relayouts >= 3  # shifts for long newcomers, re-packs past the model's positions


@pytest.mark.parametrize("kind", ["tiny_export", "tiny_export_shared"])
def test_newcomers_when_the_shared_length_reaches_the_models_positions(kind, request):
    gen = Generator(request.getfixturevalue(kind))
    assert [len(gen.tokenizer.encode(t)) for t in EDGE_TEXTS] == [12, 10, 3]
    slot = SlotLM(gen.graph, rows=3)
    got = run(slot, gen, EDGE_TEXTS, EDGE)
    for i, (_, p, n) in enumerate(EDGE):
        assert got[i] == gen.generate(EDGE_TEXTS[p], max_new_tokens=n, **GREEDY).token_ids, f"request {i} ({kind})"


def test_slot_lm_refuses_what_it_cannot_hold(tiny_export):
    gen = Generator(tiny_export)
    slot = SlotLM(gen.graph, rows=2)
    with pytest.raises(GenerationError, match="3 rows asked for, 2 free"):
        slot.join([[1], [2], [3]], 0)
    with pytest.raises(ValueError, match="not live"):
        slot.free(0)
    with pytest.raises(GenerationError, match="needs at least 1 row"):
        SlotLM(gen.graph, rows=0)


def test_masked_slots_left_by_a_long_row_are_repacked_away(tiny_export_shared):
    """A long row leaves and a short one stays: the next step re-packs instead of reading the long row's slots
    (decode steps read every slot up to P, masked or not); the short row's tokens stay its own."""
    gen = Generator(tiny_export_shared)
    short, long_ = gen.tokenizer.encode(TEXTS[0]), gen.tokenizer.encode(TEXTS[2])  # 4 and 13 tokens
    slot = SlotLM(gen.graph, rows=2)
    lp = slot.join([short, long_], gen.pad_token_id)
    tokens = [int(lp[0].argmax())]
    slot.free(1)  # the long row leaves: P stays at its 13 slots, 9 of them masked for the short row
    for _ in range(3):
        tokens.append(int(slot.step(np.array([tokens[-1]]))[0].argmax()))
        assert slot.past_len == slot.lengths[0]  # no masked slot before the row
    assert slot.slots_read == slot.slots_used
    assert tokens == gen.generate(TEXTS[0], max_new_tokens=4, **GREEDY).token_ids
