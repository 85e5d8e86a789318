"""A certified sparse head on a --head tail export (issue 31.1): speculative decoding's verify step certifies
each of its k + 1 positions on its own instead of running the 50,257-wide head k + 1 times. Greedy speculative
ids equal plain decoding's on the same folder and on its parent, top-k speculative sampling follows the parent's
distribution (the chi-square test of tests/support/speculative.py), positions the bounds cannot certify take the
parent's head in one run, and a step that needs log-probs gets the parent's, at every position.

The model is conftest's peaked checkpoint (random tables give flat logits that nothing certifies)."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2edge.errors import SparseHeadError
from gpt2edge.manifest import load_manifest
from gpt2edge.runtime.generator import Generator
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.lm import OrtLM
from gpt2edge.runtime.sparse_head import lm as sparse_lm
from gpt2edge.runtime.sparse_head import native
from tests.conftest import peaked_checkpoint
from tests.support.speculative import PROMPTS, assert_same_greedy, check_sampling_distribution

# accuracy level 4 (int8 activations): a verify step's rows and plain decoding's one row can round an activation
# to a neighbouring int8 code, so greedy picks may split where the top two log-probs are this close
# (tests/runtime/test_speculative_quantized.py); fp32 compute: the fp32 tie
NEAR_TIE = {"fp32": 1e-5, "int8": 0.1, "int4": 0.1}
KINDS = [("shared", "fp32"), ("shared", "int8"), ("shared", "int4"), ("concat", "int4")]
IDS = ["-".join(k) for k in KINDS]


@pytest.fixture(scope="module")
def tail_grid(tiny_checkpoint, tmp_path_factory) -> dict:
    """(kv cache, precision) -> (parent --head tail folder, its sparse-head folder)."""
    from gpt2edge.export import export_model
    from gpt2edge.quantize.handler import make_recipe, quantize_model
    from gpt2edge.sparse.handler import sparse_head

    root = tmp_path_factory.mktemp("sparse-tail")
    ckpt = peaked_checkpoint(tiny_checkpoint, root / "ckpt")
    out = {}
    for kv in ("shared", "concat"):
        fp32 = root / f"{kv}-fp32"
        export_model(str(ckpt), fp32, kv_cache=kv, head="tail", run_validation=False, log=None)
        for p in ("fp32", "int8", "int4"):
            if (kv, p) not in KINDS:
                continue
            parent = fp32 if p == "fp32" else root / f"{kv}-{p}"
            if p != "fp32":
                quantize_model(fp32, parent, make_recipe(p), report=False)
            sparse_head(parent, root / f"{kv}-{p}-sparse", rank=4, candidates_k=32, log=None)
            out[kv, p] = parent, root / f"{kv}-{p}-sparse"
    # the sampling test's model: the same low-rank table scaled down, so that top-k's draws are not all the best
    # token (the bounds stay tight: the table's rank, not its scale, makes them)
    soft = _scaled(ckpt, root / "soft-ckpt", 0.25)
    export_model(str(soft), root / "soft-fp32", kv_cache="shared", head="tail", run_validation=False, log=None)
    quantize_model(root / "soft-fp32", root / "soft-int8", make_recipe("int8"), report=False)
    sparse_head(root / "soft-int8", root / "soft-int8-sparse", rank=4, candidates_k=32, log=None)
    out["soft"] = root / "soft-int8", root / "soft-int8-sparse"
    return out


def _scaled(src, out, factor: float):
    """The checkpoint with its tied table times `factor`."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(src).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(factor)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    GenerationConfig.from_pretrained(src).save_pretrained(out)
    return out


def test_the_sparse_folder_of_a_tail_export_is_a_tail_folder(tail_grid):
    """Its manifest keeps the tail head, `hidden` is (batch, keep, C), and the native step's tables are there."""
    parent, sp = tail_grid["shared", "int4"]
    m = load_manifest(sp).raw
    assert m["graph"]["head"] == "tail"
    assert m["graph"]["outputs"][0]["shape"] == ["batch", "keep", load_manifest(parent).dims.n_embd]
    assert m["sparse_head"]["fused"]["candidates"] == 32
    g = Generator(sp)
    assert g.graph.tail and g.graph.certify
    assert g.graph.fused_k == (32 if native.LIBRARY is not None else None)


@pytest.mark.parametrize("key", KINDS, ids=IDS)
def test_speculative_greedy_on_a_sparse_tail_target(tail_grid, key):
    """Prompt lookup and fixed k on the sparse folder: the same ids as plain decoding of the folder and of its
    parent (up to a near-tie at int8 activations), the verify positions served by the certified head."""
    parent, sp = tail_grid[key]
    full, plain = Generator(parent), Generator(sp)
    kw = dict(max_new_tokens=40, do_sample=False, ignore_eos=True)
    for k in (None, 1, 5):
        spec = Generator(sp, prompt_lookup=2, draft_tokens=k)
        spec.graph.reset_stats()
        verify_steps = 0
        for prompt in PROMPTS:
            a, b, c = full.generate(prompt, **kw), plain.generate(prompt, **kw), spec.generate(prompt, **kw)
            assert_same_greedy(parent, a.prompt_token_ids, a.token_ids, b.token_ids, tie=NEAR_TIE[key[1]])
            assert_same_greedy(parent, a.prompt_token_ids, b.token_ids, c.token_ids, tie=NEAR_TIE[key[1]])
            verify_steps += c.timings["target_steps"]
        st = spec.graph.stats
        # each emitted or rejected position was a head evaluation (the prefill's one each), nearly all certified,
        # in fewer verify steps than tokens
        assert st.full == 0 and st.steps >= len(PROMPTS) * kw["max_new_tokens"] and st.certified >= 0.8 * st.steps
        assert verify_steps < len(PROMPTS) * (kw["max_new_tokens"] - 1)


def test_without_the_native_library_the_numpy_path_verifies(tail_grid, monkeypatch):
    """No native step (not built, or GPT2EDGE_NATIVE=0): a tail body has no step of its own, so each position
    runs the NumPy path (bound.onnx, then exact rows); the same greedy ids, positions still certified."""
    parent, sp = tail_grid["shared", "int8"]
    monkeypatch.setattr(sparse_lm, "LIBRARY", None)
    spec = Generator(sp, prompt_lookup=2)
    assert spec.graph.fused_k is None and spec.graph.certify
    spec.graph.reset_stats()
    kw = dict(max_new_tokens=30, do_sample=False, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        a, b = Generator(parent).generate(prompt, **kw), spec.generate(prompt, **kw)
        assert_same_greedy(parent, a.prompt_token_ids, a.token_ids, b.token_ids, tie=NEAR_TIE["int8"])
    st = spec.graph.stats
    assert st.full == 0 and st.certified >= 0.8 * st.steps


def test_a_draft_model_on_a_sparse_tail_target(tail_grid):
    """A draft folder (the same model at fp32, full head) drafting for the sparse int4 target: plain greedy ids
    (a test of exactness only: the draft is warned about as bigger than the target)."""
    parent, sp = tail_grid["shared", "int4"]
    draft = tail_grid["shared", "fp32"][0]
    with pytest.warns(UserWarning, match="not smaller"):  # the sparse body reads less than any full head
        spec = Generator(sp, draft=draft, draft_tokens=3)
    plain = Generator(sp)
    spec.graph.reset_stats()
    for prompt in PROMPTS:
        kw = dict(max_new_tokens=30, do_sample=False, ignore_eos=True)
        a, b = plain.generate(prompt, **kw), spec.generate(prompt, **kw)
        assert_same_greedy(parent, a.prompt_token_ids, a.token_ids, b.token_ids, tie=NEAR_TIE["int4"])
        assert b.timings["accepted_tokens"] > 0
    assert spec.graph.stats.certified >= 0.8 * spec.graph.stats.steps


def test_verify_rows_are_the_parents(tail_grid):
    """forward(keep=n) of a sparse tail LM: with log-probs asked for (no head configured), the parent's verify
    log-probs at every position, bit for bit; configured for greedy, rows whose argmax is the parent's."""
    parent, sp = tail_grid["shared", "int8"]
    folder = ModelFolder.open(parent)
    g = Generator(sp).graph
    rng = np.random.default_rng(0)
    for configure in (False, True):
        g.reset_stats()
        for _ in range(6):
            P, K = int(rng.integers(3, 30)), int(rng.integers(2, 9))
            ids, mask = rng.integers(0, 400, (1, P + K)), np.ones((1, P + K), np.int64)
            a, b = OrtLM(folder), g.new_lm()
            for lm in (a, b):
                lm.start(1, P + K)
            if configure:
                b.configure_head(Generator(sp).sampling_params(do_sample=False))
            for lm in (a, b):
                lm.forward(ids[:, :P], mask[:, :P], np.arange(P)[None])
            want = np.array(a.forward(ids[:, P:], mask, np.arange(P, P + K)[None], keep=K))
            got = np.array(b.forward(ids[:, P:], mask, np.arange(P, P + K)[None], keep=K))
            assert got.shape == want.shape == (1, K, folder.dims.vocab_size)
            if configure:
                assert np.array_equal(got.argmax(-1), want.argmax(-1))
            else:
                assert np.array_equal(got, want)
        # configured: the positions were certified (rows of -inf beyond those read); else every one the full head
        assert (g.stats.certified >= 0.5 * g.stats.steps) if configure else (g.stats.full == g.stats.steps > 0)


def test_uncertified_verify_positions_take_the_parents_head_in_one_run(tail_grid, monkeypatch):
    """No position certified: each verify step runs the full head once for all of its positions, and greedy
    speculative ids stay the plain ones."""
    parent, sp = tail_grid["shared", "fp32"]
    spec = Generator(sp, prompt_lookup=2, draft_tokens=4)
    if spec.graph.fused_k is None:
        pytest.skip("the native sparse step is not built (a tail body has no step of its own)")
    real_rows, runs = native.NativeStep.rows, []

    def no_certificate(self, r, B, k):
        real_rows(self, r, B, k)
        r.ok[:B] = 0

    real_head = sparse_lm.SparseGraph.full_head

    def counted(self, h):
        runs.append(len(h))
        return real_head(self, h)

    monkeypatch.setattr(native.NativeStep, "rows", no_certificate)
    monkeypatch.setattr(sparse_lm.SparseGraph, "full_head", counted)
    spec.graph.reset_stats()
    kw = dict(max_new_tokens=30, do_sample=False, ignore_eos=True)
    a, b = Generator(parent).generate(PROMPTS[0], **kw), spec.generate(PROMPTS[0], **kw)
    assert a.token_ids == b.token_ids
    st = spec.graph.stats
    assert st.certified == 0 and st.fallbacks == st.steps == sum(runs)
    assert max(runs) > 1 and len(runs) == b.timings["target_steps"] + 1  # one run a step (the prefill's too)


def test_speculative_sampling_on_a_sparse_tail_target_follows_the_parents_distribution(tail_grid, monkeypatch):
    """Top-k sampling (certified as top-k: its k best logits) with prompt lookup: the chi-square test against
    the parent's exact distribution passes, and the two broken acceptance rules fail it."""
    parent, sp = tail_grid["soft"]
    spec = Generator(sp, prompt_lookup=2, draft_tokens=2)
    spec.graph.reset_stats()
    check_sampling_distribution(parent, spec, "sparse tail int8", monkeypatch)
    st = spec.graph.stats
    assert st.full == 0 and st.certified >= 0.5 * st.steps


def test_a_head_all_export_is_refused(tiny_checkpoint, tmp_path):
    from gpt2edge.export import export_model
    from gpt2edge.sparse.handler import sparse_head

    src = tmp_path / "all"
    export_model(str(tiny_checkpoint), src, head="all", run_validation=False, log=None)
    with pytest.raises(SparseHeadError, match="--head all export"):
        sparse_head(src, tmp_path / "out", log=None)
    assert not (tmp_path / "out").exists()


def test_the_approximate_mode_of_a_tail_export_is_refused(tail_grid, tmp_path):
    """--mode cluster would pass approximate rows to an exact verify rule: one line, nothing written."""
    from gpt2edge.sparse.approx_handler import cluster_sparse_head

    parent, _ = tail_grid["shared", "int8"]
    with pytest.raises(SparseHeadError, match="--head tail export; --mode cluster"):
        cluster_sparse_head(parent, tmp_path / "approx", clusters=16, probe=4, report=False, log=None)
    assert not (tmp_path / "approx").exists()
