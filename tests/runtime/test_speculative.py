"""Speculative decoding (issue 12, item 2): the tail head, cache rollback, greedy identity with plain decoding on
both graph kinds and both drafters, the sampling rule's output distribution, and bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2edge.errors import ConvertError, GenerationError, ModelFolderError, QuantizeError
from gpt2edge.manifest import KEEP_INPUT, load_manifest, write_manifest
from gpt2edge.runtime import Generator, SamplingParams
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.lm import MAX_SHAPE_BINDINGS, OrtLM
from gpt2edge.runtime.speculative.cache import CachedSequence
from gpt2edge.runtime.speculative.drafters import lookup
from gpt2edge.runtime.speculative.rules import check_params
from tests.support.speculative import PROMPTS, assert_same_greedy, check_sampling_distribution


def _export(ckpt: Path, out: Path, **kw) -> Path:
    from gpt2edge.export import export_model

    export_model(str(ckpt), out, **kw)
    return out


def _quantize(src: Path, out: Path) -> Path:
    from gpt2edge.quantize import make_recipe, quantize_model

    quantize_model(src, out, make_recipe("int4"), report=False)
    return out


@pytest.fixture(scope="module")
def targets(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """The tiny model with a tail head, on each KV cache kind (validated against PyTorch on export)."""
    root = tmp_path_factory.mktemp("spec")
    return {
        kind: _export(tiny_checkpoint, root / f"tail-{kind}", head="tail", kv_cache=kind)
        for kind in ("concat", "shared")
    }


@pytest.fixture(scope="module")
def drafts(tiny_export, tiny_export_shared, tmp_path_factory) -> dict[str, Path]:
    """int4 copies of the same model (they agree with it often, not always), on each KV cache kind."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        "concat": _quantize(tiny_export, root / "int4-concat"),
        "shared": _quantize(tiny_export_shared, root / "int4-shared"),
    }


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> Path:
    """Another random model with the same tokenizer: its drafts are mostly rejected (q far from p)."""
    from gpt2edge.export import make_random_checkpoint

    root = tmp_path_factory.mktemp("stranger")
    ckpt = make_random_checkpoint(root / "ckpt", size="tiny", seed=1)
    return _export(ckpt, root / "export", run_validation=False)


# --- the tail head and OrtLM.forward(keep=n) ---------------------------------------------------------------


def test_tail_export_has_a_keep_input_and_validates(targets):
    for path in targets.values():
        m = dict(load_manifest(path).raw)
        assert m["graph"]["head"] == "tail"
        assert m["graph"]["inputs"][-1] == {"name": KEEP_INPUT, "dtype": "int64", "shape": ["keep"]}
        assert m["graph"]["outputs"][0]["shape"][:2] == ["batch", "keep"]
        # validation asked the tail graph for every position and compared them with PyTorch
        assert all(c["ok"] for c in m["validation"]["checks"]) and len(m["validation"]["checks"]) == 4


@pytest.mark.parametrize("kind", ["concat", "shared"])
@pytest.mark.parametrize("io_binding", [True, False])
def test_forward_keep_equals_the_head_all_graph(targets, tiny_export_all, kind, io_binding):
    ids = np.random.default_rng(3).integers(0, 300, (1, 12))
    mask = np.ones((1, 12), np.int64)

    def run(path, keep):
        lm = OrtLM(ModelFolder.open(path), io_binding=io_binding)
        lm.start(1, 16)
        first = lm.forward(ids[:, :8], mask[:, :8], np.arange(8)[None]).copy()  # (1, V)
        return first, np.array(lm.forward(ids[:, 8:], mask, np.arange(8, 12)[None], keep=keep))

    ref_first, ref = run(tiny_export_all, 4)  # (1, 4, V): every position of the step
    for keep in (None, 1, 3, 4):
        first, got = run(targets[kind], keep)
        assert np.abs(first - ref_first).max() < 1e-4
        want = ref[:, -1] if keep is None else ref[:, -keep:]
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-4


def test_keep_on_a_last_position_head_is_refused(tiny_export):
    lm = OrtLM(ModelFolder.open(tiny_export))
    lm.start(1, 8)
    with pytest.raises(ModelFolderError, match="--head tail"):
        lm.forward(np.zeros((1, 3), np.int64), np.ones((1, 3), np.int64), np.arange(3)[None], keep=2)


# --- rollback ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["concat", "shared"])
def test_rollback_gives_the_log_probs_of_the_kept_tokens(targets, kind):
    """Feed a prompt, then drafts, reject some, feed on: the log-probs equal a fresh run on the live tokens."""
    prompt, drafts, after = [5, 17, 99, 3, 42], [7, 8, 9, 10], [11, 12, 13]
    seq = CachedSequence(OrtLM(ModelFolder.open(targets[kind])), 40, dead_room=8)
    seq.feed(prompt)
    seq.feed(drafts, keep=len(drafts))
    seq.truncate(len(prompt) + 1)  # keep the first draft token, reject three
    got = np.array(seq.feed(after, keep=len(after)))
    fresh = CachedSequence(OrtLM(ModelFolder.open(targets[kind])), 40)
    fresh.feed(prompt + drafts[:1])
    want = np.array(fresh.feed(after, keep=len(after)))
    assert np.abs(got - want).max() < 1e-4
    assert seq.tokens == prompt + drafts[:1] + after
    if kind == "shared":  # the valid length moved back: no dead slot
        assert seq.lm.past_len == len(seq.tokens)
    else:  # the rejected slots stay, masked out; no copy
        assert seq.lm.past_len == len(prompt) + len(drafts) + len(after)
        assert seq.mask[0, : seq.lm.past_len].sum() == len(seq.tokens) and seq.compactions == 0


def test_tail_steps_of_changing_shapes_reuse_their_bindings_and_stay_exact(targets):
    """A tail head on a shared cache keeps one IO binding per step shape (S, keep): verify steps whose k changes
    every step re-bind nothing, and what they return equals a run without IO binding, also after a start that
    reallocates the cache and after the tail buffer grows (every kept binding then points at freed memory and
    must go)."""
    folder = ModelFolder.open(targets["shared"])
    bound, plain = OrtLM(folder), OrtLM(folder, io_binding=False)
    made = []
    real = bound.session.io_binding
    bound.session = _Spy(bound.session, lambda: made.append(real()) or made[-1])
    rng = np.random.default_rng(5)

    def run(capacity: int, sizes: list[int]) -> None:
        seqs = [CachedSequence(lm, capacity) for lm in (bound, plain)]
        prompt = rng.integers(0, 300, 6).tolist()
        for seq in seqs:
            seq.feed(prompt)
        for S in sizes:
            tokens, live = rng.integers(0, 300, S).tolist(), len(seqs[0].tokens)
            got, want = (np.array(seq.feed(tokens, keep=S)) for seq in seqs)
            assert np.abs(got - want).max() < 1e-5
            for seq in seqs:
                seq.truncate(live + 1)  # accept one, reject the rest

    run(64, [3, 5, 3, 2, 5, 3, 2])
    assert len(made) == 4  # the prompt's shape, then 3, 5, 2 once each: the later steps re-bind nothing
    run(64, [3, 5])  # a new generation on the same buffers keeps them
    assert len(made) == 4
    run(200, [3, 5])  # a larger reservation reallocates the cache: bound afresh
    assert len(made) == 7
    run(200, [20, 3])  # a step wider than the tail buffer's 17 rows grows it: the old bindings go with it
    assert len(made) == 9
    run(200, [3])
    assert len(made) == 10
    # endless new shapes (prefills of every length) keep at most MAX_SHAPE_BINDINGS bindings, still exact
    seqs = [CachedSequence(lm, 64) for lm in (bound, plain)]
    for S in range(1, MAX_SHAPE_BINDINGS + 9):  # within the tiny model's 128 positions
        tokens = rng.integers(0, 300, S).tolist()
        got, want = (np.array(seq.feed(tokens, keep=1)) for seq in seqs)
        assert np.abs(got - want).max() < 1e-5
        for seq in seqs:
            seq.truncate(0)
        assert len(bound._shape_bindings) <= MAX_SHAPE_BINDINGS


class _Spy:
    """A session whose io_binding() is counted; everything else is the session's."""

    def __init__(self, session, io_binding) -> None:
        self._session, self.io_binding = session, io_binding

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_concat_cache_compacts_once_its_dead_room_is_spent(targets):
    lm = OrtLM(ModelFolder.open(targets["concat"]))
    seq = CachedSequence(lm, 8, dead_room=4)  # 12 slots: the last feed needs 13
    fresh = CachedSequence(OrtLM(ModelFolder.open(targets["concat"])), 12)
    live = [1, 2, 3]
    seq.feed(live)
    for tok in (4, 5, 6):
        seq.feed([tok, 90, 91], keep=3)  # one token kept, two rejected each round
        seq.truncate(len(live) + 1)
        live.append(tok)
    got, want = seq.feed([7]), fresh.feed(live + [7])
    assert seq.compactions >= 1 and lm.cache.allocations == 1  # a copy inside the reserved buffers
    assert np.abs(got - want).max() < 1e-4


# --- greedy: token-identical to plain decoding ---------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:the draft")  # the stranger is as big as the target: warned, and fine here
@pytest.mark.parametrize("kind", ["concat", "shared"])
@pytest.mark.parametrize("drafter", ["lookup", "int4-concat", "int4-shared", "stranger"])
def test_greedy_is_token_identical_to_plain_greedy(targets, drafts, stranger, kind, drafter):
    plain = Generator(targets[kind])
    source = {"lookup": {"prompt_lookup": 2}, "stranger": {"draft": stranger}}
    spec_kw = source.get(drafter) or {"draft": drafts[drafter.split("-")[1]]}
    accepted = rejected = 0
    for k in (None, 1, 5):
        spec = Generator(targets[kind], draft_tokens=k, **spec_kw)
        for prompt in PROMPTS:
            kw = dict(max_new_tokens=40, do_sample=False, ignore_eos=True)
            a, b = plain.generate(prompt, **kw), spec.generate(prompt, **kw)
            assert_same_greedy(targets[kind], a.prompt_token_ids, a.token_ids, b.token_ids)
            accepted += b.timings["accepted_tokens"]
            rejected += b.timings["draft_tokens"] - b.timings["accepted_tokens"]
    assert rejected > 0  # the rollback ran
    if drafter != "stranger":
        assert accepted > 0  # so did acceptance


def test_greedy_identity_with_penalty_eos_and_stop(targets, drafts):
    """The processors next_tokens applies, and the finish reasons, are the same with speculation."""
    plain, spec = Generator(targets["concat"]), Generator(targets["concat"], draft=drafts["concat"])
    for kw in (
        dict(repetition_penalty=1.3, ignore_eos=True),
        dict(min_new_tokens=5),
        dict(stop=["e"], ignore_eos=True),
    ):
        a = plain.generate("The river rose", max_new_tokens=30, do_sample=False, **kw)
        b = spec.generate("The river rose", max_new_tokens=30, do_sample=False, **kw)
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_a_head_all_target_works_too(tiny_export_all, drafts):
    plain, spec = Generator(tiny_export_all), Generator(tiny_export_all, draft=drafts["concat"])
    for prompt in PROMPTS[:2]:
        a = plain.generate(prompt, max_new_tokens=30, do_sample=False, ignore_eos=True)
        b = spec.generate(prompt, max_new_tokens=30, do_sample=False, ignore_eos=True)
        assert_same_greedy(tiny_export_all, a.prompt_token_ids, a.token_ids, b.token_ids)
        assert b.timings["target_steps"] < len(b.token_ids) - 1  # some steps verified several drafts


@pytest.mark.parametrize("kind", ["concat", "shared"])
def test_greedy_identity_without_io_binding(targets, drafts, kind):
    plain = Generator(targets[kind], io_binding=False)
    spec = Generator(targets[kind], io_binding=False, draft=drafts[kind], draft_tokens=3)
    for prompt in PROMPTS[:2]:
        a = plain.generate(prompt, max_new_tokens=30, do_sample=False, ignore_eos=True)
        b = spec.generate(prompt, max_new_tokens=30, do_sample=False, ignore_eos=True)
        assert_same_greedy(targets[kind], a.prompt_token_ids, a.token_ids, b.token_ids)
        assert b.timings["draft_tokens"] > b.timings["accepted_tokens"]


def test_stream_equals_generate_and_concurrent_calls_stay_independent(targets, drafts):
    from concurrent.futures import ThreadPoolExecutor

    spec = Generator(targets["shared"], draft=drafts["shared"])
    kw = dict(max_new_tokens=24, do_sample=False, ignore_eos=True)
    alone = {p: spec.generate(p, **kw).token_ids for p in PROMPTS}
    result: list = []
    assert "".join(spec.stream(PROMPTS[0], result=result, **kw)) == result[0].text
    assert result[0].token_ids == alone[PROMPTS[0]]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: spec.generate(p, **kw).token_ids, PROMPTS * 2))
    assert got == [alone[p] for p in PROMPTS * 2]


def _spinning(session) -> bool:
    """Whether the session's idle intra-op threads spin (ONNX Runtime's default: the entry is absent)."""
    try:
        return session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") != "0"
    except RuntimeError:
        return True


def test_with_a_draft_model_neither_session_spins(targets, drafts):
    """Target and draft alternate token by token: spinning idle threads of one would take the other's cores."""
    spec = Generator(targets["shared"], draft=drafts["shared"])
    assert not _spinning(spec.graph.session) and not _spinning(spec.speculator._pool.graph.session)
    assert _spinning(Generator(targets["shared"], prompt_lookup=2).graph.session)  # one session: the default
    assert _spinning(Generator(targets["shared"]).graph.session)


# --- sampling: the target's distribution -------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["int4", "lookup"])
def test_sampling_follows_the_target_distribution(targets, drafts, drafter, monkeypatch):
    """Chi-square of the first N_TOKENS tokens' joint distribution against the exact one, for plain sampling
    (the calibration), speculative sampling, and two broken rules (which must fail it)."""
    kind = "concat" if drafter == "int4" else "shared"
    folder = targets[kind]
    spec_kw = {"draft": drafts["concat"]} if drafter == "int4" else {"prompt_lookup": 2}
    check_sampling_distribution(folder, Generator(folder, draft_tokens=2, **spec_kw), drafter, monkeypatch)


# --- the pieces ----------------------------------------------------------------------------------------------


def test_prompt_lookup_copies_what_followed_the_last_ngram():
    h = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert lookup(h, 3, 2) == [4, 5]  # "1 2 3" occurred before, followed by 4 5
    assert lookup(h, 3, 10) == [4, 5, 9, 1, 2, 3]  # as far as the history goes
    assert lookup([7, 8, 9, 8], 2, 3) == [9, 8]  # no 2-gram match: the 1-gram "8"
    assert lookup([1, 2, 3], 2, 4) == []  # nothing repeats
    # the latest occurrence with k tokens after it wins; else the one with the most
    assert lookup([5, 1, 5, 2, 5, 3, 5], 1, 1) == [3]
    assert lookup([5, 1, 2, 5, 3, 5], 1, 2) == [3, 5]


def test_adaptive_draft_length_follows_acceptance(targets):
    from gpt2edge.runtime.speculative.speculator import ADAPTIVE_MAX, DraftLength

    k = DraftLength()
    k.update(4, 4)
    assert k.k == 6
    k.update(3, 6)  # a rejection: one more than were accepted
    assert k.k == 4
    k.update(0, 4)
    assert k.k == 1
    k.update(1, 1)
    assert k.k == 3
    for _ in range(20):
        k.update(k.k, k.k)
    assert k.k == ADAPTIVE_MAX
    fixed = DraftLength(3, adaptive=False)
    fixed.update(0, 3)
    assert fixed.k == 3


# --- bad input -----------------------------------------------------------------------------------------------


def _copy_with(src: Path, dst: Path, manifest_edit=None, tokenizer_edit=None) -> Path:
    shutil.copytree(src, dst)
    if tokenizer_edit is not None:
        tok = json.loads((dst / "tokenizer.json").read_text())
        tokenizer_edit(tok)
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    m = dict(load_manifest(dst).raw)
    if manifest_edit is not None:
        manifest_edit(m)
    write_manifest(dst, m)
    return dst


def test_a_draft_with_another_vocabulary_is_refused(targets, tiny_export, tmp_path):
    def swap_two_tokens(tok):
        vocab = tok["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[10:12]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    other = _copy_with(tiny_export, tmp_path / "other-tok", tokenizer_edit=swap_two_tokens)
    with pytest.raises(ModelFolderError, match="tokenizer.json vocabularies differ"):
        Generator(targets["concat"], draft=other)
    real = Path("/work/shared/trained-gpt2-py")
    if real.is_dir():  # a real GPT-2 vocabulary of 50,257 tokens against the tiny model's 400
        from gpt2edge.export import export_model

        export_model(str(real), tmp_path / "py", run_validation=False)
        with pytest.raises(ModelFolderError, match="another vocabulary"):
            Generator(targets["concat"], draft=tmp_path / "py")


def test_a_trimmed_vocabulary_draft_needs_the_same_trim_on_the_target(targets, tiny_export, tmp_path):
    from gpt2edge.trim.handler import trim_vocab

    ids = tmp_path / "keep.json"
    ids.write_text(json.dumps(list(range(300)) + [Generator(tiny_export).eos_token_id[0]]))
    trimmed = tmp_path / "trimmed"
    trim_vocab(tiny_export, trimmed, keep_ids=ids, report=False)
    with pytest.raises(ModelFolderError, match="vocabulary-trimmed"):
        Generator(targets["concat"], draft=trimmed)


def test_a_draft_not_smaller_than_the_target_warns(targets):
    with pytest.warns(UserWarning, match="not smaller"):
        Generator(targets["concat"], draft=targets["concat"])


def test_bad_speculative_arguments_are_refused(targets, tiny_export, drafts):
    with pytest.raises(GenerationError, match="--prompt-lookup must be an integer >= 1"):
        Generator(targets["concat"], prompt_lookup=0)
    with pytest.raises(GenerationError, match="--draft-tokens must be an integer >= 1"):
        Generator(targets["concat"], prompt_lookup=2, draft_tokens=0)
    with pytest.raises(GenerationError, match="exactly one of"):
        Generator(targets["concat"], prompt_lookup=2, draft=drafts["concat"])
    with pytest.raises(GenerationError, match="exactly one of"):
        Generator(targets["concat"], draft_tokens=3)
    with pytest.raises(ModelFolderError, match="export the target with --head tail"):
        Generator(tiny_export, prompt_lookup=2)
    spec = Generator(targets["concat"], prompt_lookup=2)
    with pytest.raises(GenerationError, match="one prompt at a time"):
        spec.generate(["a", "b"])


def test_beam_search_and_unknown_processors_are_refused():
    Beam = dataclasses.make_dataclass("Beam", [("num_beams", int, 1)], bases=(SamplingParams,), frozen=True)
    check_params(Beam(num_beams=1))
    with pytest.raises(GenerationError, match="beam search"):
        check_params(Beam(num_beams=4))
    # a processor added to SamplingParams later (here a made-up one) is refused until this module reproduces it
    Eta = dataclasses.make_dataclass("Eta", [("eta_cutoff", float, 0.0)], bases=(SamplingParams,), frozen=True)
    check_params(Eta())
    with pytest.raises(GenerationError, match="does not support eta_cutoff=0.1"):
        check_params(Eta(eta_cutoff=0.1))


def test_draft_with_beams_or_logprobs_is_refused(targets):
    spec = Generator(targets["concat"], prompt_lookup=2)
    with pytest.raises(GenerationError, match="one sequence per prompt"):
        spec.generate("The river", num_beams=2, max_new_tokens=4)
    with pytest.raises(GenerationError, match="logprobs is not recorded by speculative decoding"):
        spec.generate("The river", logprobs=2, max_new_tokens=4)


def test_head_all_is_refused_by_quantize_and_tail_by_genai_with_the_fix(targets, tiny_export_all, tmp_path):
    from gpt2edge.convert import convert_folder
    from gpt2edge.quantize import make_recipe, quantize_model

    with pytest.raises(QuantizeError, match="--head all export; quantize a generation export"):
        quantize_model(tiny_export_all, tmp_path / "q", make_recipe("int4"))
    with pytest.raises(ConvertError, match="--head tail export"):
        convert_folder(targets["concat"], tmp_path / "g", "genai")


# --- CLI -----------------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt2edge.cli", *args], capture_output=True, text=True)


def test_cli_generate_and_bench(targets, drafts):
    t = str(targets["shared"])
    plain = _cli("generate", t, "-p", "The river", "-n", "20", "--greedy", "--ignore-eos", "--json")
    spec = _cli(
        "generate",
        t,
        "-p",
        "The river",
        "-n",
        "20",
        "--greedy",
        "--ignore-eos",
        "--json",
        "--draft",
        str(drafts["shared"]),
    )
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert b["token_ids"] == a["token_ids"] and 0 <= b["acceptance_rate"] <= 1
    bad = _cli("generate", t, "-p", "x", "--prompt-lookup", "0")
    assert bad.returncode == 2 and "Invalid value for '--prompt-lookup'" in bad.stderr
    same = _cli("generate", t, "-p", "x", "-n", "3", "--draft", t)
    assert same.returncode == 0 and "warning: the draft" in same.stderr
    bench = _cli(
        "bench", t, "--prompt-lookup", "2", "--prompt-len", "8", "--new-tokens", "12", "--repeat", "1", "--json"
    )
    r = json.loads(bench.stdout)
    assert r["greedy_identical"] and r["runs"] == 1
    assert {"acceptance_rate", "tokens_per_target_step", "speculative_ms_per_token", "plain_ms_per_token"} <= set(r)
