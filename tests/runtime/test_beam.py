"""Beam search and several sequences per prompt: transformers parity for both graph kinds, the KV cache rows
reordered and copied in place, one prefill per prompt, reproducible samples, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.errors import GenerationError
from gpt2edge.runtime import GenerationResult, Generator, available_devices
from gpt2edge.runtime.decoding.beam import time_beam_search
from gpt2edge.runtime.decoding.beam_search import BeamSearch, top_k_sorted
from gpt2edge.runtime.model.kv_cache import KVCache, SharedKVCache

EOS_EARLY = 19  # a token the tiny model emits within a few steps: makes hypotheses end early
MARGIN = 2e-5  # ORT and PyTorch log-probs differ by ~1e-6; a closer decision could go either way


@pytest.fixture(scope="module", params=["concat", "shared"])
def export(request, tiny_export, tiny_export_shared):
    return tiny_export if request.param == "concat" else tiny_export_shared


def _padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(map(len, prompts))
    ids = torch.full((len(prompts), S), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, S - len(p) :] = torch.tensor(p)
        mask[b, S - len(p) :] = 1
    return ids, mask


def hf_beam(hf_model, prompts: list[list[int]], pad: int, eos: int, **kw):
    """transformers' beam search on a left-padded batch -> (generated ids per returned sequence, scores, output)."""
    ids, mask = _padded(prompts, pad)
    out = hf_model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=eos,
        return_dict_in_generate=True,
        output_scores=True,
        **kw,
    )
    lengths = (out.beam_indices != -1).sum(1)  # generated length of each returned sequence
    S = ids.shape[1]
    seqs = [out.sequences[i, S : S + int(n)].tolist() for i, n in enumerate(lengths)]
    return seqs, out.sequences_scores.tolist(), out


def stopped_by(eos: int, max_new: int):
    def stopped(seqs: np.ndarray) -> np.ndarray:
        if seqs.shape[2] >= max_new:
            return np.ones(seqs.shape[:2], dtype=bool)
        return seqs[:, :, -1] == eos

    return stopped


def replay(out, n_prompts: int, eos: int, kw: dict) -> tuple[BeamSearch, float]:
    """Feed transformers' own per-step log-probs to BeamSearch; also returns the closest call it had to make
    (gap between neighbouring candidate scores, and between returned scores)."""
    nb, max_new = kw["num_beams"], kw["max_new_tokens"]
    beams = BeamSearch(
        n_prompts, nb, max_new, 1, kw.get("length_penalty", 1.0), kw.get("early_stopping", False), fill=0
    )
    margin = np.inf
    for scores in out.scores:
        lp = scores.numpy()
        total = (lp.reshape(n_prompts, nb, -1) + beams.running_scores[:, :, None]).reshape(n_prompts, -1)
        top = -np.sort(-total, axis=1)[:, : 2 * nb + 1]
        real = top > -1e8
        margin = min(margin, float(np.where(real[:, 1:], top[:, :-1] - top[:, 1:], np.inf).min()))
        beams.step(lp, stopped_by(eos, max_new))
        if beams.done:
            break
    n = kw.get("num_return_sequences", 1)
    return beams, min(margin, float((beams.scores[:, : n - 1] - beams.scores[:, 1:n]).min(initial=np.inf)))


def score_tol(length: int, length_penalty: float) -> float:
    # a negative length_penalty multiplies the summed log-prob by len**-lp, and its rounding error with it
    return 1e-4 * max(1.0, length**-length_penalty)


BATCH = ["A", "Visitors walk along the old harbour", "The city"]
PAIR = ["The river rose and", "Children learned to swim"]
CASES = [  # (prompts, eos, search and processor options, whether a returned sequence ends with EOS early)
    (BATCH, 0, dict(num_beams=2), False),
    (BATCH, 0, dict(num_beams=3, num_return_sequences=2), False),
    (BATCH, 0, dict(num_beams=4, num_return_sequences=4), False),
    (BATCH, 0, dict(num_beams=5, num_return_sequences=3), False),
    (BATCH, EOS_EARLY, dict(num_beams=2, num_return_sequences=2, early_stopping=True), True),
    (BATCH, EOS_EARLY, dict(num_beams=3, num_return_sequences=3, early_stopping="never", length_penalty=2.0), False),
    (BATCH, EOS_EARLY, dict(num_beams=4, num_return_sequences=4, length_penalty=0.5), True),
    (BATCH, EOS_EARLY, dict(num_beams=5, num_return_sequences=5, early_stopping=True, length_penalty=-1.0), True),
    (PAIR, EOS_EARLY, dict(num_beams=2, num_return_sequences=2, early_stopping="never"), True),
    (PAIR, EOS_EARLY, dict(num_beams=3, num_return_sequences=3, length_penalty=0.0), True),
    (["Visitors walk along the old harbour"], EOS_EARLY, dict(num_beams=4, num_return_sequences=2), True),
    (["Visitors walk along the old harbour"], EOS_EARLY, dict(num_beams=4, repetition_penalty=1.3), True),
    (
        ["Visitors walk along the old harbour"],
        EOS_EARLY,
        dict(num_beams=4, num_return_sequences=4, min_new_tokens=3),
        True,
    ),
    (["A"], EOS_EARLY, dict(num_beams=4, num_return_sequences=4, min_new_tokens=5), True),
]


@pytest.mark.parametrize("prompts,eos,options,early", CASES)
def test_beam_search_equals_transformers(export, hf_model, prompts, eos, options, early):
    g = Generator(export)
    g.eos_token_id = (eos,)
    kw = dict(max_new_tokens=12, **options)
    groups = g.generate(prompts, **kw)
    n = options.get("num_return_sequences", 1)
    rows = [r for grp in groups for r in (grp if n > 1 else [grp])]
    ref, ref_scores, out = hf_beam(hf_model, [r.prompt_token_ids for r in rows[::n]], g.pad_token_id, eos, **kw)
    replayed, margin = replay(out, len(prompts), eos, kw)
    assert margin > MARGIN, f"the reference has a near-tie ({margin:.1e}): pick another case"
    assert [r.token_ids for r in rows] == ref
    lp = options.get("length_penalty", 1.0)
    for r, s in zip(rows, ref_scores):
        assert r.sequence_score == pytest.approx(s, abs=score_tol(len(r.token_ids), lp))
    # each prompt's sequences are its best, best first, and say why they ended
    assert all(
        a.sequence_score >= b.sequence_score for a, b in zip(rows, rows[1:]) if a.prompt_token_ids == b.prompt_token_ids
    )
    for r in rows:
        assert r.finish_reason == ("eos" if r.token_ids[-1] == eos else "length")
        assert r.text == g.tokenizer.decode(r.token_ids)
    assert early == any(r.finish_reason == "eos" and len(r.token_ids) < 12 for r in rows)
    assert all(len(r.token_ids) >= options.get("min_new_tokens", 1) for r in rows)


@pytest.mark.parametrize("prompts,eos,options,early", CASES[:8:2] + CASES[8:])
def test_bookkeeping_replays_transformers_exactly(hf_model, tiny_export, prompts, eos, options, early):
    """Fed transformers' own log-probs, BeamSearch takes every decision the same way (no numerical noise)."""
    g = Generator(tiny_export)
    kw = dict(max_new_tokens=12, **options)
    encoded = [g.tokenizer.encode(p) for p in prompts]
    ref, ref_scores, out = hf_beam(hf_model, encoded, g.pad_token_id, eos, **kw)
    beams, _ = replay(out, len(prompts), eos, kw)
    n = options.get("num_return_sequences", 1)
    got = [hyp for group in beams.best(n) for hyp in group]
    assert [ids for ids, _ in got] == ref
    assert np.allclose([s for _, s in got], ref_scores, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,k", [(12, 4), (2000, 10), (4 * 50257, 8), (6, 6)])
def test_top_k_sorted_is_a_stable_full_sort_prefix(n, k):
    rng = np.random.default_rng(n)
    scores = rng.standard_normal((3, n)).astype(np.float32)
    scores[0, ::3] = scores[0, 0]  # ties, some of them among the best
    scores[1, n // 2 :] = -np.inf  # most of a row ruled out, as EOS suppression does
    scores[2, 1:] -= 1e9  # beams 1.. of the first step: every candidate but a few is -1e9 + x
    ref = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # best first, ties by lower index
    assert np.array_equal(top_k_sorted(scores, k), ref)


def test_result_shapes(tiny_export):
    g = Generator(tiny_export)
    one = g.generate("The river", num_beams=3, max_new_tokens=6)
    assert isinstance(one, GenerationResult) and one.sequence_score is not None
    assert "reorder_ms_per_step" in one.timings and "sequence_score" in one.to_json()
    many = g.generate("The river", num_beams=3, num_return_sequences=2, max_new_tokens=6)
    assert isinstance(many, list) and len(many) == 2 and all(isinstance(r, GenerationResult) for r in many)
    nested = g.generate(["The river", "A"], num_beams=3, num_return_sequences=3, max_new_tokens=6)
    assert [len(grp) for grp in nested] == [3, 3]
    assert nested[0][0].token_ids == one.token_ids  # the best beam does not depend on how many are returned
    assert [r.token_ids for r in nested[0][:2]] == [r.token_ids for r in many]
    samples = g.generate(["The river", "A"], num_return_sequences=2, temperature=1.0, seed=1, max_new_tokens=6)
    assert [len(grp) for grp in samples] == [2, 2] and samples[0][0].sequence_score is None


def test_io_binding_on_and_off_give_the_same_beams(export):
    kw = dict(num_beams=4, num_return_sequences=4, max_new_tokens=10)
    bound = Generator(export).generate(BATCH, **kw)
    plain = Generator(export, io_binding=False).generate(BATCH, **kw)
    assert [[r.token_ids for r in g] for g in bound] == [[r.token_ids for r in g] for g in plain]
    assert np.allclose([r.sequence_score for g in bound for r in g], [r.sequence_score for g in plain for r in g])


def written_pointers(lm) -> list[int]:
    """Where ONNX Runtime wrote the last step's presents: the IO binding's outputs after the log-probs."""
    return [o.data_ptr() for o in lm.binding.get_outputs()[1:]]


def cache_pointers(cache: KVCache) -> set[int]:
    """Every address the cache binds as a present: its buffers (both ping-pong slots of a concat cache)."""
    if isinstance(cache, SharedKVCache):
        return {cache._storage[i].ctypes.data for i in range(cache.n_tensors)}
    return {cache.pointer(slot, t) for slot in (0, 1) for t in range(cache.n_tensors)}


def test_beams_reorder_the_cache_in_place(export):
    g = Generator(export)
    lm = g.lm
    written: list[list[int]] = []
    g.generate(
        BATCH, num_beams=4, max_new_tokens=16, ignore_eos=True, callback=lambda s: written.append(written_pointers(lm))
    )
    allowed = cache_pointers(lm.cache)
    # one allocation for P*num_beams rows; ORT wrote every step's cache into it (after reorders too)
    assert lm.cache.allocations == 1 and lm.cache.batch == len(BATCH) * 4
    assert len(written) == 16 and all(set(step) <= allowed for step in written)
    scratch = getattr(lm.cache, "_scratch", None)
    g.generate(BATCH, num_beams=4, max_new_tokens=16, ignore_eos=True)
    assert lm.cache.allocations == 1 and cache_pointers(lm.cache) == allowed
    if scratch is not None:  # shared cache: the reorder scratch is reused as well
        assert lm.cache._scratch is scratch


def _concat_rows(cache: KVCache, L: int) -> np.ndarray:
    """The current past as (n_tensors, rows, nh, L, hs)."""
    n = cache.rows * cache.n_head * L * cache.head_dim
    flat = cache._storage[cache.src, :, :n]
    return flat.reshape(cache.n_tensors, cache.rows, cache.n_head, L, cache.head_dim)


@pytest.mark.parametrize("index", [[2, 2, 0, 1], [3, 2, 1, 0], [0, 0, 0, 0], [1, 1, 3, 3]])
def test_concat_cache_reorder_and_expand_rows(index):
    cache = KVCache(n_layer=2, n_head=2, head_dim=3)
    cache.reserve(batch=4, length=7)
    L = 5
    rng = np.random.default_rng(0)
    _concat_rows(cache, L)[...] = rng.standard_normal((4, 4, 2, L, 3))
    before, pointers = _concat_rows(cache, L).copy(), cache_pointers(cache)
    cache.reorder_rows(np.array(index), L)
    assert np.array_equal(_concat_rows(cache, L), before[:, index])
    assert cache_pointers(cache) == pointers and cache.allocations == 1
    # a prefill of 2 rows copied into 2 rows each
    cache.reserve(batch=4, length=7)
    cache.set_rows(2)
    _concat_rows(cache, L)[...] = rng.standard_normal((4, 2, 2, L, 3))
    before = _concat_rows(cache, L).copy()
    cache.expand_rows(2, L)
    assert cache.rows == 4 and np.array_equal(_concat_rows(cache, L), before[:, [0, 0, 1, 1]])
    assert cache.allocations == 1


def test_concat_cache_identity_reorder_moves_nothing():
    cache = KVCache(n_layer=1, n_head=1, head_dim=2)
    cache.reserve(batch=3, length=4)
    cache.reorder_rows(np.arange(3), 3)
    assert cache.src == 0


@pytest.mark.parametrize("index", [[2, 2, 0, 1], [3, 2, 1, 0], [0, 0, 0, 0], [0, 1, 2, 2]])
def test_shared_cache_reorder_rows_only_up_to_the_valid_length(index):
    cache = SharedKVCache(n_layer=2, n_head=2, head_dim=3)
    cache.reserve(batch=4, length=8)
    rng = np.random.default_rng(1)
    cache._storage[...] = rng.standard_normal(cache._storage.shape)
    before, pointers = cache._storage.copy(), cache_pointers(cache)
    L = 5
    cache.reorder_rows(np.array(index), L)
    assert np.array_equal(cache._storage[:, :, :, :L], before[:, index, :, :L])
    assert np.array_equal(cache._storage[:, :, :, L:], before[:, :, :, L:])  # slots past L are not touched
    assert cache_pointers(cache) == pointers and cache.allocations == 1
    cache.reorder_rows(np.array([3, 2, 1, 0]), L)  # swaps need the scratch buffer
    scratch = cache._scratch
    cache.reorder_rows(np.array([1, 0, 3, 2]), L)
    assert scratch is not None and cache._scratch is scratch  # allocated once, reused
    cache.set_rows(2)
    before = cache._storage.copy()
    cache.expand_rows(2, L)
    assert cache.rows == 4 and np.array_equal(cache._storage[:, :, :, :L], before[:, [0, 0, 1, 1], :, :L])


def test_samples_prefill_once_and_equal_a_batch_of_copies(export):
    g = Generator(export)
    prefills: list[tuple[int, int]] = []
    real = g.lm.forward

    def spy(ids, mask, positions):
        if ids.shape[1] > 1:
            prefills.append(ids.shape)
        return real(ids, mask, positions)

    g.lm.forward = spy
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=40, seed=5, ignore_eos=True)
    prompts = ["The river", "Children learned to swim"]
    groups = g.generate(prompts, num_return_sequences=3, **kw)
    assert len(prefills) == 1 and prefills[0][0] == 2  # the two prompts ran once, not six times
    tokens = [[r.token_ids for r in grp] for grp in groups]
    assert all(len({tuple(t) for t in grp}) == 3 for grp in tokens)  # three different samples per prompt
    # the copied cache rows give exactly what six separate prefills give, draw for draw
    copies = g.generate([p for p in prompts for _ in range(3)], **kw)
    assert [t for grp in tokens for t in grp] == [r.token_ids for r in copies]
    again = g.generate(prompts, num_return_sequences=3, **kw)
    assert [[r.token_ids for r in grp] for grp in again] == tokens  # same seed, same samples
    other = g.generate(prompts, num_return_sequences=3, **{**kw, "seed": 6})
    assert [[r.token_ids for r in grp] for grp in other] != tokens


def test_beams_prefill_once(tiny_export):
    g = Generator(tiny_export)
    calls: list[tuple[int, int]] = []
    real = g.lm.forward
    g.lm.forward = lambda ids, mask, pos: calls.append(ids.shape) or real(ids, mask, pos)
    g.generate(BATCH, num_beams=4, max_new_tokens=5, ignore_eos=True)
    assert calls[0][0] == 3 and calls[0][1] > 1  # prefill: the three prompts once
    assert all(shape == (12, 1) for shape in calls[1:]) and len(calls) == 5


def test_interrupt_keeps_the_best_so_far(tiny_export):
    g = Generator(tiny_export)

    def ctrl_c(step):
        if step.index == 3:
            raise KeyboardInterrupt

    rs = g.generate(
        "The river", num_beams=3, num_return_sequences=3, max_new_tokens=20, ignore_eos=True, callback=ctrl_c
    )
    assert len(rs) == 3 and all(r.finish_reason == "interrupted" and len(r.token_ids) == 4 for r in rs)
    assert rs[0].sequence_score >= rs[1].sequence_score >= rs[2].sequence_score
    drawn = g.generate("The river", num_return_sequences=2, temperature=0.9, max_new_tokens=20, callback=ctrl_c)
    assert all(r.finish_reason == "interrupted" and len(r.token_ids) == 4 for r in drawn)


def test_stop_string_ends_a_beam(tiny_export):
    g = Generator(tiny_export)
    base = g.generate("The city", num_beams=2, max_new_tokens=16, ignore_eos=True)
    stop = base.text[4:7]
    assert stop and stop in base.text
    rs = g.generate("The city", num_beams=2, num_return_sequences=2, max_new_tokens=16, ignore_eos=True, stop=[stop])
    for r in rs:
        assert stop not in r.text
        if r.finish_reason == "stop":
            assert stop in g.tokenizer.decode(r.token_ids) and len(r.token_ids) < 16
    assert any(r.finish_reason == "stop" for r in rs)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(num_beams=2, num_return_sequences=3), r"num_return_sequences \(3\) must be <= num_beams \(2\)"),
        (dict(num_beams=3, do_sample=True), "beam sampling is not supported"),
        (dict(num_beams=3, temperature=0.7), "beam sampling is not supported"),
        (dict(num_beams=0), "num_beams must be an integer >= 1"),
        (dict(num_beams=-2), "num_beams must be an integer >= 1"),
        (dict(num_beams=2, length_penalty=float("nan")), "length_penalty must be a finite number"),
        (dict(num_beams=2, length_penalty=float("inf")), "length_penalty must be a finite number"),
        (dict(num_beams=2, early_stopping="sometimes"), "early_stopping must be true, false or 'never'"),
        (dict(num_return_sequences=2, do_sample=False), "num_return_sequences=2 needs sampling"),
        (dict(num_return_sequences=0), "num_return_sequences must be an integer >= 1"),
    ],
)
def test_bad_search_parameters_are_refused_before_any_work(tiny_export, kw, message):
    g = Generator(tiny_export)
    calls = []
    g.lm.forward = lambda *a: calls.append(a)
    with pytest.raises(GenerationError, match=message):
        g.generate("The river", max_new_tokens=4, **kw)
    assert not calls


def test_cli_beam_search_json_and_text(tiny_export):
    runner = CliRunner()
    args = ["generate", str(tiny_export), "-p", "The river", "-p", "A", "-n", "5", "--num-beams", "3"]
    res = runner.invoke(main, [*args, "--num-return-sequences", "2", "--early-stopping", "never", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["results"]
    assert [r["prompt"] for r in rows] == ["The river", "The river", "A", "A"]
    assert all(r["sequence_score"] is not None for r in rows)
    g = Generator(tiny_export)
    ref = g.generate(["The river", "A"], num_beams=3, num_return_sequences=2, max_new_tokens=5, early_stopping="never")
    assert [r["token_ids"] for r in rows] == [r.token_ids for grp in ref for r in grp]
    text = runner.invoke(main, [*args, "--length-penalty", "0.5"])
    texts = [line for line in text.stdout.splitlines() if not line.startswith("--- prompt ")]  # separator lines
    assert text.exit_code == 0 and len(texts) == 2 and "score" in text.stderr


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--num-beams", "2", "--num-return-sequences", "3"], "error: num_return_sequences (3) must be <= num_beams"),
        (["--num-beams", "2", "--do-sample"], "error: Beam search (num_beams=2) is deterministic"),
    ],
)
def test_cli_bad_search_options_are_one_line_errors(tiny_export, extra, message):
    res = CliRunner().invoke(main, ["generate", str(tiny_export), "-p", "x", "-n", "3", *extra])
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.startswith(message) and res.stderr.count("\n") == 1


def test_time_beam_search_reports_each_part(export):
    g = Generator(export)
    t = time_beam_search(g.lm, [[5, 6, 7], [8]], max_new_tokens=8, num_beams=4)
    assert (t.num_beams, t.rows, t.steps) == (4, 8, 7)
    assert t.decode_ms_per_step > 0 and t.reorder_ms_per_step >= 0 and t.select_ms_per_step > 0


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in available_devices(), reason="CUDA execution provider not available")
def test_cuda_beams_and_samples_match_cpu(tiny_export):
    cpu, cuda = Generator(tiny_export), Generator(tiny_export, device="cuda")
    beams = dict(num_beams=4, num_return_sequences=2, max_new_tokens=12)
    ref = cpu.generate(BATCH, **beams)
    got = cuda.generate(BATCH, **beams)
    assert [[r.token_ids for r in g] for g in got] == [[r.token_ids for r in g] for g in ref]
    samples = dict(num_return_sequences=3, max_new_tokens=12, temperature=0.9, seed=2, ignore_eos=True)
    assert len(cuda.generate("The river", **samples)) == 3 and cuda.lm.cache.allocations <= 2
