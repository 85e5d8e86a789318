"""Structured output (gpt2edge.runtime.constraints on llguidance): every seeded sample is valid, end tokens come
only where the grammar accepts, the mask sits where transformers puts a user LogitsProcessor (after the
processors, before the warpers) with the same distribution, an allow-all mask changes nothing, and bad input is
one line before any model work."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

from gpt2edge.cli import main
from gpt2edge.errors import GenerationError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.constraints import Constraint, ConstraintError, compile_constraint
from gpt2edge.runtime.constraints.spec import MAX_TEXT_BYTES
from gpt2edge.runtime.decoding.sampling import SamplingParams, apply_processors, next_tokens, warp_row

EOS = 0  # the tiny tokenizer's <|endoftext|>
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "tags", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 5},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "boolean"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": ["string", "null"], "maxLength": 5},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def gen(tiny_export) -> Generator:
    return Generator(tiny_export)


def replay(gen: Generator, constraint: Constraint, r) -> None:
    """Every token of a result was allowed when it was drawn, an end token only where the grammar accepted,
    and a "stop" finish is a complete grammar."""
    m = compile_constraint(constraint, gen.tokenizer, gen.graph.vocab_size, gen.eos_token_id).matcher()
    for t in r.token_ids:
        assert m.allowed(gen.eos_token_id)[t], (r.token_ids, t)
        if t == EOS:
            assert m.accepts_eos and r.finish_reason == "eos"
            return
        m.advance(t)
    assert r.finish_reason == ("stop" if m.done else "length")


@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_every_seeded_sample_validates_against_its_schema(gen, schema):
    # 4 schemas x 5 seeds x 50 sequences = 1,000 samples, each parsed and validated with jsonschema
    c = Constraint.json_schema(SCHEMAS[schema])
    for seed in range(5):
        rs = gen.generate("The", constraint=c, do_sample=True, seed=seed, num_return_sequences=50, max_new_tokens=96)
        for r in rs:
            assert r.finish_reason in ("stop", "eos"), r.text
            jsonschema.validate(json.loads(r.text), SCHEMAS[schema])
        for r in rs[:5]:
            replay(gen, c, r)


def test_regex_choice_and_grammar_outputs_match(gen):
    rx = r"[a-z]{1,5}( [0-9]{1,3}){0,2}"
    c = Constraint.regex(rx)
    rs = gen.generate(["A", "B"], constraint=c, do_sample=True, seed=1, num_return_sequences=50, max_new_tokens=16)
    for r in [r for group in rs for r in group]:
        assert re.fullmatch(rx, r.text), r.text
        replay(gen, c, r)
    assert {r.finish_reason for group in rs for r in group} <= {"eos", "stop"}
    choices = ["yes", "no", "maybe not"]
    rs = gen.generate("Q", constraint=Constraint.choice(choices), do_sample=True, seed=2, num_return_sequences=50)
    assert {r.text for r in rs} <= set(choices) and len({r.text for r in rs}) > 1
    assert {r.finish_reason for r in rs} == {"stop"}  # a finite language: complete without an end token
    gbnf = Constraint.grammar('root ::= "(" digit{1,3} ")"\ndigit ::= [0-9]\n')
    lark = Constraint.grammar('start: "(" DIGITS ")"\nDIGITS: /[0-9]{1,3}/\n')
    assert gbnf.kind == "gbnf" and lark.kind == "lark"
    for g in (gbnf, lark):
        for r in gen.generate("x", constraint=g, do_sample=True, seed=3, num_return_sequences=20, max_new_tokens=24):
            assert re.fullmatch(r"\([0-9]{1,3}\)", r.text) and r.finish_reason == "stop", r.text


def test_greedy_stream_and_session_turns_are_constrained(gen):
    c = Constraint.json_schema(SCHEMAS[2])
    greedy = gen.generate("The", constraint=c, max_new_tokens=48)
    jsonschema.validate(json.loads(greedy.text), SCHEMAS[2])
    result: list = []
    assert "".join(gen.stream("The", constraint=c, max_new_tokens=48, result=result)) == greedy.text
    assert result[0].token_ids == greedy.token_ids
    session = gen.session()
    first = session.generate("Q:", constraint=Constraint.regex("[0-9]{2}"), max_new_tokens=8)
    second = session.generate(" then", constraint=Constraint.choice(["up", "down"]), max_new_tokens=8)
    free = session.generate(" and", max_new_tokens=3, ignore_eos=True)  # a turn without one is free
    assert re.fullmatch("[0-9]{2}", first.text) and second.text in ("up", "down") and len(free.token_ids) == 3


def test_max_new_tokens_inside_a_structure_is_length(gen):
    r = gen.generate("The", constraint=Constraint.json_schema(SCHEMAS[1]), max_new_tokens=3)
    assert r.finish_reason == "length" and len(r.token_ids) == 3 and r.text.startswith('{"')


def test_an_allow_all_mask_leaves_greedy_ids_and_seeded_draws_unchanged(gen, monkeypatch):
    from gpt2edge.runtime.constraints import rows

    c = Constraint.regex("[a-z]+")  # compiled for real; its mask is replaced by one allowing every token
    monkeypatch.setattr(rows, "allowed_masks", lambda ms, eos: np.ones((len(ms), gen.graph.vocab_size), bool))
    monkeypatch.setattr(rows.ConstrainedRows, "advance", lambda self, row, token: False)
    for kw in (dict(do_sample=False), dict(do_sample=True, seed=5, top_k=0), dict(do_sample=True, seed=6, top_p=0.8)):
        free = gen.generate(["The", "A river"], max_new_tokens=20, **kw)
        masked = gen.generate(["The", "A river"], max_new_tokens=20, constraint=c, **kw)
        assert [r.token_ids for r in masked] == [r.token_ids for r in free]
        assert [r.finish_reason for r in masked] == [r.finish_reason for r in free]


# ---- exactness: the mask as transformers applies a user LogitsProcessor (after its processors, before warpers)


class MaskProcessor(LogitsProcessor):
    def __init__(self, allowed: np.ndarray):
        self.allowed = torch.from_numpy(allowed)

    def __call__(self, input_ids, scores):
        return scores.masked_fill(~self.allowed, -float("inf"))


def transformers_pipeline(vocab: int, p: SamplingParams, allowed: np.ndarray):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=1, n_embd=4, vocab_size=vocab))
    options = {k: getattr(p, k) for k in ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p")}
    config = GenerationConfig(
        **options,
        repetition_penalty=p.repetition_penalty,
        min_new_tokens=p.min_new_tokens,
        eos_token_id=list(p.eos_token_id),
    )
    model._prepare_special_tokens(config, kwargs_has_attention_mask=False, device="cpu")
    user = LogitsProcessorList([MaskProcessor(allowed)])
    return model._get_logits_processor(config, input_ids_seq_length=10, logits_processor=user, device="cpu")


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
        dict(temperature=1.3, top_k=0, top_p=0.95, min_p=0.05),
        dict(temperature=0.9, top_k=40, typical_p=0.8, min_new_tokens=4),
    ],
)
def test_the_masked_distribution_equals_transformers_with_a_mask_processor(options):
    V = 500
    rng = np.random.default_rng(0)
    p = SamplingParams(max_new_tokens=8, do_sample=True, eos_token_id=(EOS,), **options)
    history = rng.integers(0, V, (3, 12))
    scores = rng.standard_normal((3, V)).astype(np.float32) * 3
    scores -= np.log(np.exp(scores).sum(-1, keepdims=True))
    allowed = rng.random((3, V)) < 0.2
    allowed[:, :3] = True  # each row keeps a few tokens whatever the draw
    ref = transformers_pipeline(V, p, allowed)(torch.from_numpy(history), torch.from_numpy(scores.copy()))
    ref = torch.softmax(ref, -1).numpy()
    processed = np.where(allowed, apply_processors(scores, p, list(history), 2), -np.inf).astype(np.float32)
    ours = np.zeros_like(scores)
    for b, row in enumerate(processed):
        ids, probs = warp_row(row, p)
        ours[b, ids] = probs
    assert ((ours > 0) == (ref > 0)).all() and not (ours[~allowed] > 0).any()
    assert np.abs(ours - ref).max() < 1e-6
    # next_tokens applies this same mask at that same place: its seeded draws are those of the masked scores
    for seed in range(20):
        a = next_tokens(scores, p, list(history), 2, np.random.default_rng(seed), allowed=allowed)
        b = next_tokens(np.where(allowed, scores, -np.inf), p, list(history), 2, np.random.default_rng(seed))
        assert (a == b).all() and allowed[np.arange(3), a].all()
    greedy = SamplingParams(max_new_tokens=8, eos_token_id=(EOS,))
    picked = next_tokens(scores, greedy, list(history), 2, None, allowed=allowed)
    assert (picked == np.where(allowed, scores, -np.inf).argmax(1)).all()


@pytest.mark.parametrize("n_allowed", [1, 3, 40, 700])
def test_a_masked_row_is_sampled_as_its_allowed_tokens_only(n_allowed):
    # next_tokens samples a constrained row as the short row of its allowed tokens (sampling.py): the same
    # tokens as the masked full row, seed for seed, on a trimmed head's columns too (full ids back), with few
    # allowed tokens (fewer than top-k's k: the path that partitioned the whole row) and many; a row of the
    # batch whose mask allows everything is the unmasked row, draw for draw
    from gpt2edge.runtime.model.columns import Columns

    V, rng = 1200, np.random.default_rng(n_allowed)
    kept = np.sort(rng.choice(V, 1000, replace=False))
    scores = (rng.standard_normal((3, len(kept))) * 2).astype(np.float32)
    allowed = np.zeros(scores.shape, dtype=bool)
    for b in range(2):
        allowed[b, rng.choice(len(kept), n_allowed, replace=False)] = True
    allowed[2] = True  # allows everything
    history = [np.zeros(2, dtype=np.int64)] * 3
    for columns in (None, Columns.of(kept, V)):
        for options in (dict(top_k=50, temperature=0.8), dict(top_k=0, top_p=0.9), dict(min_p=0.1, top_k=5)):
            p = SamplingParams(max_new_tokens=8, do_sample=True, eos_token_id=(EOS,), **options)
            for seed in range(8):
                got = next_tokens(scores, p, history, 2, np.random.default_rng(seed), columns, allowed)
                masked = np.where(allowed, scores, -np.inf).astype(np.float32)
                want = next_tokens(masked, p, history, 2, np.random.default_rng(seed), columns)
                assert (got == want).all(), (options, seed, got, want)
                ids = np.arange(len(kept)) if columns is None else kept
                assert all(t in set(ids[allowed[b]].tolist()) for b, t in enumerate(got))
        picked = next_tokens(scores, SamplingParams(max_new_tokens=8, eos_token_id=(EOS,)), history, 2, None,
                             columns, allowed)  # fmt: skip
        best = np.where(allowed, scores, -np.inf).argmax(1)
        assert (picked == (best if columns is None else kept[best])).all()
    banned = np.where(allowed, -np.inf, scores).astype(np.float32)  # every allowed token banned by a processor
    for sampled in (False, True):  # greedy; sampling (a mask of 700 of 1,000 tokens: the masked row's path)
        p = SamplingParams(max_new_tokens=8, do_sample=sampled, top_k=0, eos_token_id=(EOS,))
        with pytest.raises(GenerationError, match="allows no token"):
            next_tokens(banned, p, history, 2, np.random.default_rng(0), None, allowed)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_the_masked_row_is_np_where_with_minus_inf(dtype):
    # sampling.masked_row (the wide mask's one pass) against np.where(mask, row, -inf): banned (-inf) scores,
    # masks all False, all True and random, a float16 / float64 row
    from gpt2edge.runtime.decoding.sampling import masked_row

    rng = np.random.default_rng(3)
    row = (rng.standard_normal(50257) * 4).astype(dtype)
    row[rng.integers(0, row.size, 300)] = -np.inf
    masks = [rng.random(row.size) < 0.9, np.zeros(row.size, bool), np.ones(row.size, bool), rng.random(row.size) < 0.1]
    for mask in masks:
        want, got = np.where(mask, row, np.float32(-np.inf)), masked_row(row, mask)
        assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("scale", [3.0, 0.0])  # spread-out scores; then every score rounded: runs of ties
def test_a_wide_mask_under_top_k_draws_as_the_masked_full_row(scale):
    # with top-k and more allowed tokens than k, sampling.py samples only the allowed tokens that can reach
    # top-k's pool (_allowed_pool), not all 45,000 of a prose-like class (without top-k, the masked row itself): at
    # GPT-2's width, with ties at the k-th score and rows where the pool falls back, every draw equals the masked
    # full row's
    V, rng = 50257, np.random.default_rng(7)
    raw = rng.standard_normal((4, V)) * (scale or 3.0) - 12
    scores = (raw if scale else np.round(raw)).astype(np.float32)
    allowed = rng.random((4, V)) < np.array([[0.9], [0.5], [0.05], [0.002]])
    history = [np.zeros(2, dtype=np.int64)] * 4
    for options in (dict(top_k=50, temperature=0.8), dict(top_k=5, min_p=0.1), dict(top_k=400, top_p=0.9),
                    dict(top_k=0, temperature=0.8)):  # fmt: skip
        p = SamplingParams(max_new_tokens=8, do_sample=True, eos_token_id=(EOS,), **options)
        for seed in range(6):
            got = next_tokens(scores, p, history, 2, np.random.default_rng(seed), None, allowed)
            masked = np.where(allowed, scores, -np.inf).astype(np.float32)
            want = next_tokens(masked, p, history, 2, np.random.default_rng(seed))
            assert (got == want).all(), (options, seed, got, want)
            assert allowed[np.arange(4), got].all()
    # greedy: the first of the allowed tied best, also where the row's own first best is not allowed
    picked = next_tokens(scores, SamplingParams(max_new_tokens=8, eos_token_id=(EOS,)), history, 2, None, None, allowed)
    assert (picked == np.where(allowed, scores, -np.inf).argmax(1)).all()


def test_nine_ulps_below_is_at_or_below_nine_nextafter_steps():
    # _allowed_pool's bound on scaled_top_k's tie stepping (sampling.below_nine_ulps): never above nine float32
    # steps toward -inf, at binade edges, near zero and among subnormals, on both signs
    from gpt2edge.runtime.decoding.sampling import below_nine_ulps

    rng = np.random.default_rng(0)
    edges = [np.float32(2.0**e) for e in range(-130, 120, 7)]
    values = [*(rng.standard_normal(2000) * 30).astype(np.float32), *edges, *[-e for e in edges], np.float32(0.0),
              np.float32(1e-45), np.float32(-1e-45), np.finfo(np.float32).tiny]  # fmt: skip
    for x in values:
        stepped = x
        for _ in range(9):
            stepped = np.nextafter(stepped, np.float32(-np.inf))
        assert below_nine_ulps(x) <= stepped, x


# ---- paths that refuse a constraint, or take it on a trimmed / static folder


def test_beam_search_keeps_a_matcher_per_beam(gen):
    rx = "[a-z]{2,4}( [0-9]{1,2})?"
    groups = gen.generate(["The", "A"], constraint=Constraint.regex(rx), num_beams=4, num_return_sequences=3)
    for group in groups:
        assert len(group) == 3 and all(re.fullmatch(rx, r.text) for r in group), [r.text for r in group]
        assert [r.sequence_score for r in group] == sorted((r.sequence_score for r in group), reverse=True)
    c = Constraint.json_schema(SCHEMAS[2])
    for r in gen.generate("The", constraint=c, num_beams=3, num_return_sequences=3, max_new_tokens=40):
        jsonschema.validate(json.loads(r.text), SCHEMAS[2])
    with pytest.raises(GenerationError, match="ignore_eos"):
        gen.generate("The", constraint=c, num_beams=2, ignore_eos=True)


def test_speculative_decoding_checks_drafts_against_the_matcher(tiny_export_all):
    # drafts the grammar refuses have probability 0 under the masked target: rejected, the matcher rolled back;
    # greedy output is plain constrained greedy's, token for token
    plain, spec = Generator(tiny_export_all), Generator(tiny_export_all, prompt_lookup=1, draft_tokens=3)
    for c in (Constraint.json_schema(SCHEMAS[2]), Constraint.regex("[a-z]{2,6}( [a-z]{2,6}){0,3}")):
        want = plain.generate("ab ab ab", constraint=c, max_new_tokens=40)
        got = spec.generate("ab ab ab", constraint=c, max_new_tokens=40)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    for seed in range(10):
        r = spec.generate("The", constraint=Constraint.json_schema(SCHEMAS[2]), do_sample=True, seed=seed)
        jsonschema.validate(json.loads(r.text), SCHEMAS[2])
    with pytest.raises(ConstraintError, match="Constraint"):
        plain.generate("The", constraint="[a-z]+")


def test_a_trimmed_head_takes_the_mask_on_its_kept_columns(tiny_export, tmp_path):
    from gpt2edge.trim.handler import trim_vocab

    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps([EOS, *range(1, 60)]))
    trim_vocab(tiny_export, tmp_path / "trimmed", keep_ids=keep, report=False)
    g = Generator(tmp_path / "trimmed")
    kept = set(g.lm.columns.ids.tolist())
    rs = g.generate("x", constraint=Constraint.regex("[0-9]{2,4}"), do_sample=True, seed=0, num_return_sequences=10)
    for r in rs:
        assert re.fullmatch("[0-9]{2,4}", r.text) and set(r.token_ids) <= kept


def test_a_constraint_that_needs_a_dropped_token_is_refused(gen):
    # trim-vocab always keeps the 256 byte tokens (any text stays spellable), so this takes a hand-made column
    # map: a head whose columns hold no digit at all
    from gpt2edge.runtime.constraints.rows import ConstrainedRows
    from gpt2edge.runtime.model.columns import Columns

    no_digit = [i for i in range(400) if not re.search("[0-9]", gen.tokenizer.decode([i], skip_special_tokens=False))]
    compiled = compile_constraint(Constraint.regex("[0-9]+"), gen.tokenizer, 400, gen.eos_token_id)
    rows = ConstrainedRows(compiled, 2, gen.eos_token_id, Columns.of(np.array(no_digit), 400))
    with pytest.raises(ConstraintError, match="trimmed head dropped") as e:
        rows.masks(np.array([True, True]))
    assert "\n" not in str(e.value)
    kept = ConstrainedRows(compiled, 1, gen.eos_token_id, Columns.of(np.arange(400), 400)).masks(np.array([True]))
    assert kept.shape == (1, 400) and kept.sum() == len(set(range(400)) - set(no_digit))


def test_choices_with_quotes_backslashes_newlines_and_emoji(gen):
    options = ['a "q"', "back\\slash", "é😀", "new\nline"]
    rs = gen.generate("x", constraint=Constraint.choice(options), do_sample=True, seed=0, num_return_sequences=30)
    assert {r.text for r in rs} <= set(options)


def test_without_the_structured_extra_a_constraint_names_the_install(gen, monkeypatch):
    from gpt2edge import extras
    from gpt2edge.errors import MissingExtraError

    real = extras.find_spec
    monkeypatch.setattr(extras, "find_spec", lambda name: None if name == "llguidance" else real(name))
    with pytest.raises(MissingExtraError, match=r"pip install 'gpt2edge\[structured\]'"):
        gen.generate("x", constraint=Constraint.regex("[a-z]+"))


# ---- bad input: one line, before any model work, bounded by the limits


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: Constraint.json_schema("{bad"), "not valid JSON"),
        (lambda: Constraint.json_schema("[1, 2]"), "is an object"),
        (lambda: Constraint.json_schema("x" * (10 * 2**20)), "limit is"),
        (lambda: Constraint.json_schema('{"items":' * 10_000 + "{}" + "}" * 10_000), "10001 levels deep"),
        (lambda: Constraint.regex("(" * 10_000 + ")" * 10_000), "levels deep"),
        (lambda: Constraint.choice([]), "non-empty"),
        (lambda: Constraint.choice("yes"), "list of strings"),
        (lambda: Constraint("xml", "<a/>"), "Unknown constraint kind"),
        (lambda: Constraint.regex(""), "empty"),
    ],
)
def test_malformed_constraints_are_refused_in_one_line(make, match):
    with pytest.raises(ConstraintError, match=match) as e:
        make()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "c,match",
    [
        (Constraint.json_schema({"type": "array", "uniqueItems": True}), "does not support: uniqueItems"),
        (Constraint.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable"),
        (Constraint.regex("(ab"), "unclosed group"),
        (Constraint.lark("start: ("), "lark"),
        (Constraint.gbnf("root ::= missing"), "not found"),
        (Constraint.regex(r"[^\s\S]"), "empty"),
    ],
)
def test_what_the_engine_refuses_is_one_line(gen, c, match):
    with pytest.raises(GenerationError, match=match) as e:
        gen.generate("The", constraint=c, max_new_tokens=4)
    assert "\n" not in str(e.value)


def test_a_catastrophic_regex_compiles_and_generates(gen):
    # backtracking engines take exponential time on (a+)+$; llguidance's derivative lexer does not backtrack
    r = gen.generate("a", constraint=Constraint.regex("(a+)+$"), max_new_tokens=8, do_sample=True, seed=0)
    assert re.fullmatch("a+", r.text)


def test_a_cheap_mask_of_one_row_is_computed_in_line_and_waiting_is_not_cost(gen, monkeypatch):
    # the handoff rule (rows.HANDOFF_MS): a one-row forward whose last mask cost less CPU than the handoff, or
    # less than the last forward (prefetch() to masks()), leaves the next mask to masks(); a mask costlier than
    # both, or a forward of several rows, computes it in the background. The cost is the computing thread's CPU
    # time: a mask that waited (here: slept) 20 ms is still a cheap one
    import time

    from gpt2edge.runtime.constraints import rows as rows_module
    from gpt2edge.runtime.constraints.rows import ConstrainedRows

    compiled = compile_constraint(Constraint.regex("[a-z]+"), gen.tokenizer, gen.graph.vocab_size, gen.eos_token_id)
    real = rows_module.allowed_masks

    def waits_then_masks(ms, eos):
        time.sleep(0.02)
        return real(ms, eos)

    monkeypatch.setattr(rows_module, "allowed_masks", waits_then_masks)
    one = np.array([True])
    g = ConstrainedRows(compiled, 1, gen.eos_token_id, None)
    first = g.masks(one)  # (the first mask builds the engine's lazy state)
    g.prefetch(one, rows_in_step=4)  # several rows in the forward: always in the background
    assert g._pending is not None and (g.masks(one) == first).all()
    assert g._mask_ms < 10  # computed in the worker after a 20 ms sleep: the sleep is not its cost
    g._mask_ms = rows_module.HANDOFF_MS / 2
    g.prefetch(one, rows_in_step=1)
    assert g._pending is None and (g.masks(one) == first).all()  # in line
    g._mask_ms = 5 * rows_module.HANDOFF_MS  # a costly grammar state
    g.prefetch(one, rows_in_step=1)
    assert g._pending is not None and (g.masks(one) == first).all()
    g.prefetch(one, rows_in_step=1)
    time.sleep(10 * rows_module.HANDOFF_MS / 1e3)  # a forward (prefetch() to masks()) longer than that mask
    assert (g.masks(one) == first).all() and g._forward_ms >= 10 * rows_module.HANDOFF_MS
    g._mask_ms = 5 * rows_module.HANDOFF_MS  # as costly, after that forward: in line, since a worker would slow
    g.prefetch(one, rows_in_step=1)  # the next forward by more than it hides
    assert g._pending is None and (g.masks(one) == first).all()
    g._mask_ms, g._forward_ms = 5 * rows_module.HANDOFF_MS, 0.0  # a quick forward again: the worker takes it
    g.prefetch(one, rows_in_step=1)
    assert g._pending is not None and (g.masks(one) == first).all()


def test_one_mask_task_for_a_server_step_gives_each_group_its_own_masks(gen, monkeypatch):
    # prefetch_batch (the continuous scheduler's one background task per step) hands each group the masks its own
    # masks() computes: constraints of four kinds in mid-document states, a finished row, a dead beam; an engine
    # error in one group's row fails that group alone
    from gpt2edge.runtime.constraints import rows as rows_module
    from gpt2edge.runtime.constraints.rows import ConstrainedRows, prefetch_batch

    cases = [  # per group: each row's text so far
        (Constraint.json_schema(SCHEMAS[1]), ['{"', "", '{"']),
        (Constraint.regex("[0-9]{2}: [A-Za-z ,.]{1,60}"), ["12: He", "1", "12: Hello"]),
        (Constraint.choice(["yes", "no"]), ["", "yes", "n"]),
        (Constraint.regex("[a-z]+"), ["ab", "", "x"]),
        (Constraint.regex("[a-z]+"), ["", "abc", "q"]),  # the same compiled constraint: unpacked with the one above
    ]
    actives = [np.array(a, dtype=bool) for a in ([1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1])]

    def groups() -> list[ConstrainedRows]:
        out = []
        for c, texts in cases:
            g = ConstrainedRows(compile_constraint(c, gen.tokenizer, gen.graph.vocab_size, gen.eos_token_id), 3,
                                gen.eos_token_id, None)  # fmt: skip
            for m, text in zip(g.matchers, texts):
                for t in gen.tokenizer.encode(text):
                    m.advance(t)
            out.append(g)
        out[1].matchers[2].dead = True  # a beam its grammar refused: allows nothing
        return out

    def batched_shares_one_constraint(gs: list[ConstrainedRows]) -> bool:
        return gs[3].matchers[0].compiled is gs[4].matchers[0].compiled

    none_live = groups()[1]
    none_live.matchers[0].dead = True  # the active rows all dead or finished: no engine call, nothing allowed
    assert not none_live.masks(np.array([True, False, True])).any(axis=1)[[0, 2]].any()
    own = [g.masks(a) for g, a in zip(groups(), actives)]
    assert not (own[0] == own[1]).all() and not own[1][2].any() and own[2][0].all()
    eos = gen.eos_token_id[0]
    assert own[3][0, eos] and not own[3][1, eos]  # rows of one group differ in whether they may end
    assert batched_shares_one_constraint(groups())
    batched = groups()
    prefetch_batch(list(zip(batched, actives)), rows_in_step=12)
    batched[0]._pending[1].result()
    monkeypatch.setattr(rows_module, "allowed_masks", None)  # collecting must not compute a group's masks again
    for g, a, want in zip(batched, actives, own):
        got = g.masks(a)
        assert got.shape == want.shape and (got == want).all()
    monkeypatch.undo()

    failing = groups()

    def limit_hit():
        raise ConstraintError("lexer limit")

    failing[4].matchers[1].check = limit_hit
    prefetch_batch(list(zip(failing, actives)), rows_in_step=12)
    for i, (g, a, want) in enumerate(zip(failing, actives, own)):
        if i == 4:
            with pytest.raises(ConstraintError, match="lexer limit"):
                g.masks(a)
        else:
            assert (g.masks(a) == want).all()


def test_the_word_slices_leave_every_mask_as_the_engine_computes_it_without_slices(gen, tiny_export):
    # engine.WORD_SLICES only skip trie walks (llguidance's slicer): each step's mask along seeded outputs equals
    # the one a matcher on the same tokenizer with no slices at all computes
    import llguidance
    import llguidance.numpy as llg_np
    from tokenizers import Tokenizer

    from gpt2edge.runtime.constraints import engine

    text = (tiny_export / "tokenizer.json").read_text()
    n = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    bare = llguidance.LLTokenizer(text, n_vocab=n, eos_token=list(gen.eos_token_id), slices=[])
    schema = json.dumps(SCHEMAS[1])
    cases = [(Constraint.regex(rx), llguidance.grammar_from("regex", rx)) for rx in ("[0-9]{2}: [A-Za-z ,.]{1,60}",
             "[a-z ]{1,40}")]  # fmt: skip
    cases.append((Constraint.json_schema(SCHEMAS[1]),
                  llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=engine.JSON_OPTIONS)))  # fmt: skip
    steps = 0
    for c, grammar in cases:
        compiled = compile_constraint(c, gen.tokenizer, gen.graph.vocab_size, gen.eos_token_id)
        for seed in range(3):
            r = gen.generate("The", constraint=c, do_sample=True, seed=seed, temperature=1.5, max_new_tokens=30)
            ours, plain = compiled.matcher(), llguidance.LLMatcher(bare, grammar, log_level=0)
            for t in r.token_ids:
                words = np.zeros((1, (n + 31) // 32), dtype=np.int32)
                llg_np.fill_next_token_bitmask(plain, words, 0)
                want = np.unpackbits(words.view(np.uint8), bitorder="little")[:n].astype(bool)
                want[list(compiled.engine_eos)] = False  # the end token: the call's to allow (allowed())
                assert (ours.allowed()[:n] == want).all(), (c, seed, t)
                steps += 1
                if t in gen.eos_token_id:
                    break
                ours.advance(t)
                assert plain.consume_token(t)
    assert steps > 60


def test_compiled_constraints_are_cached(gen):
    from gpt2edge.runtime.constraints import compile_for

    c = Constraint.json_schema(SCHEMAS[0])
    assert compile_for(gen, c) is compile_for(gen, Constraint.json_schema(SCHEMAS[0]))


def test_cli_constraint_flags(tiny_export, tmp_path):
    run = lambda *a: CliRunner().invoke(main, ["generate", str(tiny_export), "-p", "x", "--no-stream", *a])
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[2]))
    r = run("--json-schema", str(schema), "-n", "40", "--json")
    assert r.exit_code == 0, r.output
    jsonschema.validate(json.loads(json.loads(r.stdout)["text"]), SCHEMAS[2])
    r = run("--json-schema", json.dumps(SCHEMAS[2]), "-n", "40", "--json")
    assert r.exit_code == 0 and json.loads(json.loads(r.stdout)["text"])
    r = run("--choice", "left", "--choice", "right", "--json")
    assert json.loads(r.stdout)["text"] in ("left", "right")
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "a" [0-9]\n')
    r = run("--grammar-file", str(grammar), "--json")
    assert re.fullmatch("a[0-9]", json.loads(r.stdout)["text"])
    r = run("--regex", "[0-9]{3}", "--json")
    assert re.fullmatch("[0-9]{3}", json.loads(r.stdout)["text"])
    r = run("--json-object", "-n", "64", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["text"].startswith("{")
    for args, code in [
        (("--regex", "(ab"), 1),
        (("--json-schema", '{"type": "array", "uniqueItems": true}'), 1),
        (("--json-schema", str(tmp_path / "missing.json")), 1),
        (("--regex", "a", "--choice", "b"), 2),
    ]:
        r = run(*args)
        assert r.exit_code == code, r.output
        assert "Traceback" not in r.output and re.search("^(error|Error): ", r.output, re.M), r.output
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_TEXT_BYTES + 10))
    r = run("--json-schema", str(big))
    assert r.exit_code == 1 and "error: --json-schema" in r.output


def test_static_and_sparse_folders_take_a_constraint(gen, tiny_checkpoint, tiny_export, tmp_path):
    from gpt2edge.sparse.handler import sparse_head

    r = CliRunner().invoke(main, ["export", "-m", str(tiny_checkpoint), str(tmp_path / "static"), "--static", "2x8x64"])
    assert r.exit_code == 0, r.output
    sparse_head(tiny_export, tmp_path / "sparse", rank=4, candidates_k=32)
    c = Constraint.regex("[0-9]{2,5}")
    want = [x.token_ids for x in gen.generate(["a", "b"], constraint=c, max_new_tokens=8)]
    for folder in ("static", "sparse"):  # the sparse head serves a constrained step with its full head
        got = Generator(tmp_path / folder).generate(["a", "b"], constraint=c, max_new_tokens=8)
        assert [x.token_ids for x in got] == want and all(re.fullmatch("[0-9]{2,5}", x.text) for x in got)
