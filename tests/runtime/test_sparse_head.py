"""The certified sparse head (`gpt2edge sparse-head`): greedy ids and top-k distributions identical to the full
head's, on both KV cache kinds at fp32 / int8 / int4, and every path that needs the full head exact too.

Random tables give flat logits that no bound certifies, so the model here has a low-rank tied table (a few
directions plus a little noise, scaled up): peaked distributions and tight bounds, so most steps certify and the
sparse path is what is tested. The grid of folders is conftest's sparse_grid (built once a session).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.runtime.decoding.sampling import SamplingParams, softmax
from gpt2edge.runtime.generator import Generator
from gpt2edge.runtime.sparse_head import native
from tests.support.sparse_cases import CERTIFICATE_CASES, small_groups

PROMPTS = ["The river rose and", "A quiet"]
KINDS = [(kv, p) for kv in ("concat", "shared") for p in ("fp32", "int8", "int4")]


@pytest.fixture(scope="module")
def grid(sparse_grid) -> dict:
    """(kv cache, precision) -> (parent folder, sparse folder): conftest's peaked model, built once a session."""
    return sparse_grid


@pytest.fixture(scope="module")
def gens(sparse_grid) -> dict:
    return {key: (Generator(a), Generator(b)) for key, (a, b) in sparse_grid.items()}


@pytest.fixture(scope="module")
def gens_graph(sparse_grid, gens) -> dict:
    """The same folders run with the body graph's own certified step (as without the native library)."""
    import gpt2edge.runtime.sparse_head.lm as sparse_lm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sparse_lm, "LIBRARY", None)
        out = {key: (gens[key][0], Generator(b)) for key, (_, b) in sparse_grid.items()}
    assert all(g.graph.step_arrays is None and g.graph.fused_k for _, g in out.values())
    return out


@pytest.fixture(params=["native", "graph"])
def paths(request, gens, gens_graph) -> dict:
    """gens, or gens_graph: a test run both ways."""
    return gens if request.param == "native" else gens_graph


@pytest.mark.parametrize("key", KINDS, ids=["-".join(k) for k in KINDS])
def test_greedy_ids_identical(paths, key):
    full, sparse = paths[key]
    assert sparse.graph.certify
    sparse.graph.reset_stats()
    n = 120  # long generations: up to the tiny model's 128 positions
    a = full.generate(PROMPTS, max_new_tokens=n, ignore_eos=True)
    b = sparse.generate(PROMPTS, max_new_tokens=n, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    st = sparse.graph.stats
    assert st.full == 0 and st.steps == 2 * n
    assert sparse.graph.fused_k and st.certified >= 0.8 * st.steps  # the body graph's certified step did the work
    assert st.certified * sparse.graph.fused_k <= st.rows_read < st.certified * sparse.graph.vocab_size


@pytest.mark.parametrize("key", KINDS, ids=["-".join(k) for k in KINDS])
def test_top_k_distribution_identical(gens, key):
    """The sparse row's top-k set and softmax equal the full head's log-probs' (within float rounding), and
    seeded top-k sampling draws the same tokens."""
    full, sparse = gens[key]
    params = SamplingParams(do_sample=True, top_k=5, temperature=0.7)
    ids = np.array([full.tokenizer.encode(PROMPTS[0])])
    mask, pos = np.ones_like(ids), np.arange(ids.shape[1])[None]
    lm_a, lm_b = full.graph.new_lm(), sparse.graph.new_lm()
    lm_a.start(1, ids.shape[1])
    lm_b.start(1, ids.shape[1])
    lm_b.configure_head(params)
    sparse.graph.reset_stats()
    lp = lm_a.forward(ids, mask, pos)[0]
    row = lm_b.forward(ids, mask, pos)[0]
    assert sparse.graph.stats.certified == 1
    top_a, top_b = np.sort(np.argsort(lp)[-5:]), np.sort(np.argsort(row)[-5:])
    assert np.array_equal(top_a, top_b)
    assert np.isneginf(row).sum() > 0  # rows not read stay -inf
    np.testing.assert_allclose(softmax(row[top_b] / 0.7), softmax(lp[top_a] / 0.7), atol=1e-5)
    kw = dict(max_new_tokens=30, ignore_eos=True, do_sample=True, top_k=5, temperature=0.7, seed=3)
    assert full.generate(PROMPTS[1], **kw).token_ids == sparse.generate(PROMPTS[1], **kw).token_ids


def test_full_head_calls_are_the_parents(paths):
    """Log-probs, top-p, beam search: the full head (the body graph's copy of the parent's head) every step,
    results as the parent's, bit for bit."""
    full, sparse = paths["shared", "int8"]
    sparse.graph.reset_stats()
    a = full.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True, logprobs=2)
    b = sparse.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True, logprobs=2)
    assert a.token_ids == b.token_ids
    assert [(t.logprob, [x.logprob for x in t.top_logprobs]) for t in a.logprobs] == [
        (t.logprob, [x.logprob for x in t.top_logprobs]) for t in b.logprobs
    ]
    kw = dict(max_new_tokens=12, ignore_eos=True, do_sample=True, top_p=0.9, seed=5)
    assert full.generate(PROMPTS[0], **kw).token_ids == sparse.generate(PROMPTS[0], **kw).token_ids
    beams = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2)
    ra, rb = full.generate(PROMPTS[0], **beams), sparse.generate(PROMPTS[0], **beams)
    assert [r.token_ids for r in ra] == [r.token_ids for r in rb]
    assert [r.sequence_score for r in ra] == [r.sequence_score for r in rb]
    st = sparse.graph.stats
    assert st.certified == 0 and st.full == st.steps > 0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])
def test_uncertified_steps_fall_back_and_are_counted(gens, monkeypatch, fused):
    """A step the bounds cannot certify runs the full head: still the parent's tokens, counted. Fused: no
    candidate clears a huge margin, and after each failure the next 1, 2, 4 ... steps run the full head in the body
    graph's own run (skipped) before the sparse head is tried again; NumPy path: no step may read a row."""
    import gpt2edge.runtime.sparse_head.fused as fused_mod
    import gpt2edge.runtime.sparse_head.native as native_mod

    full, sparse = gens["concat", "int4"]
    monkeypatch.setattr(sparse.graph, "max_rows", 0)
    if fused:
        monkeypatch.setattr(fused_mod, "TIE", 1e9)  # the graph's step's check
        monkeypatch.setattr(native_mod, "TIE", 1e9)  # the native step's
    else:
        monkeypatch.setattr(sparse.graph, "fused_k", None)
    sparse.graph.reset_stats()
    a = full.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
    b = sparse.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
    assert a.token_ids == b.token_ids
    st = sparse.graph.stats
    assert st.certified == 0 and st.steps == 10
    if fused:  # tried at steps 1, 3 and 6 (after skipping 1, then 2): 4 more skipped until step 10
        assert (st.fallbacks, st.skipped) == (3, 7)
    else:
        assert st.fallbacks == 10


@pytest.mark.parametrize("key", [("shared", "int8"), ("concat", "fp32")], ids=["shared-int8", "concat-fp32"])
def test_numpy_path_identical(gens, monkeypatch, key):
    """The NumPy path (folders from before the fused step, top-k at or above K, runs without IO binding) still
    gives the full head's tokens, greedy and top-k."""
    full, sparse = gens[key]
    monkeypatch.setattr(sparse.graph, "fused_k", None)
    sparse.graph.reset_stats()
    kw = dict(max_new_tokens=20, ignore_eos=True)
    assert [r.token_ids for r in full.generate(PROMPTS, **kw)] == [r.token_ids for r in sparse.generate(PROMPTS, **kw)]
    kw.update(do_sample=True, top_k=5, temperature=0.7, seed=3)
    assert full.generate(PROMPTS[1], **kw).token_ids == sparse.generate(PROMPTS[1], **kw).token_ids
    st = sparse.graph.stats
    assert st.certified >= 0.5 * st.steps and st.rows_read < st.certified * sparse.graph.vocab_size


@pytest.mark.parametrize("path", ["native", "graph"])
def test_fused_step_matches_numpy(gens, monkeypatch, path):
    """The certified step on real hidden states, native (native.py) or the body graph's own: its candidates are
    the rows of best upper bound, their logits are exact.py's (float32 sums: within 2e-5 here, FUSED_TOL =
    1.25e-4 allowed), and its bar is above every other row's exact logit."""
    from gpt2edge.runtime.sparse_head.exact import HeadKernel

    for key in (("shared", "int8"), ("concat", "int4"), ("shared", "fp32")):
        sparse = gens[key][1]
        g = sparse.graph
        if path == "graph":
            monkeypatch.setattr(g, "step_arrays", None)
        elif native.LIBRARY is None:
            pytest.skip("the native step is not built (test_library_is_built_where_a_compiler_is says why)")
        else:
            assert g.step_arrays is not None
        lm = g.new_lm()
        assert (lm.native is not None) == (path == "native")
        lm.configure_head(SamplingParams())
        ids = np.array([sparse.tokenizer.encode(PROMPTS[0])])
        lm.start(1, ids.shape[1] + 4)
        kernel = HeadKernel(g.table, g.rec.kind, g.folder.dims.n_embd)
        pos = ids.shape[1]
        lm.fused.arm(1)
        h = lm.body.forward(ids, np.ones_like(ids), np.arange(pos)[None])
        for step in range(4):
            if lm.native is not None:
                lm.native.certify(h, lm.fused.ids, lm.fused.logits, lm.fused.bar, lm.fused.read)
            kernel.prepare(h[0])
            exact = kernel.full()
            f = lm.fused
            np.testing.assert_allclose(f.logits[0], exact[f.ids[0]], rtol=1e-6, atol=2e-5)
            assert np.delete(exact, f.ids[0]).max() <= f.bar[0, 0]
            assert ((0 <= f.ids[0]) & (f.ids[0] < g.vocab_size)).all() and f.ids.shape == (1, f.K)
            nxt = np.array([[int(exact.argmax())]])
            lm.fused.arm(1)
            h = lm.body.forward(nxt, np.ones((1, pos + step + 1), dtype=np.int64), np.array([[pos + step]]))


def test_stream_and_session_identical(gens):
    full, sparse = gens["shared", "fp32"]
    kw = dict(max_new_tokens=15, ignore_eos=True)
    assert "".join(sparse.stream(PROMPTS[0], **kw)) == full.generate(PROMPTS[0], **kw).text
    sa, sb = full.session(), sparse.session()
    for turn in PROMPTS:
        assert sa.generate(turn, **kw).token_ids == sb.generate(turn, **kw).token_ids


def test_speculative_and_direct_graph_refused(grid):
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.model.lm import OrtGraph

    _, sp = grid["concat", "fp32"]
    with pytest.raises((ModelFolderError, GenerationError), match="last position only"):
        Generator(sp, prompt_lookup=2)
    with pytest.raises(ModelFolderError, match="sparse head"):
        OrtGraph(ModelFolder.open(sp))


@pytest.mark.parametrize("key", [("shared", "int8"), ("concat", "fp32")], ids=["int8", "fp32"])
def test_fused_group_bounds_hold(grid, gens, key):
    """The fused step with small groups (so that most groups are left out, unlike the tiny model's folders):
    on random activations of several scales its bar is above every row it did not return, its candidates'
    logits are exact.py's; and when it certifies, the best candidate is the full head's argmax."""
    import onnx

    from gpt2edge.runtime.model.ort_session import create_session
    from gpt2edge.runtime.sparse_head.exact import TIE, HeadKernel

    parent, _ = grid[key]
    g = gens[key][1].graph
    V, C = g.folder.dims.vocab_size, g.folder.dims.n_embd
    model, _ = small_groups(parent, V, C)
    path = parent.parent / f"fused-{'-'.join(key)}.onnx"
    onnx.save(model, str(path))
    sess = create_session(path, threads=1)
    kernel = HeadKernel(g.table, g.rec.kind, C)
    rng = np.random.default_rng(5)
    certified = 0
    for scale in (0.5, 2.0, 8.0, 32.0):
        for _ in range(5):
            h = (rng.standard_normal((1, C)) * scale).astype(np.float32)
            ids, logits, bar = sess.run(None, {"hidden": h})
            kernel.prepare(h[0])
            exact = kernel.full()
            np.testing.assert_allclose(logits[0], exact[ids[0]], rtol=1e-6, atol=2e-5)
            assert np.delete(exact, ids[0]).max() <= bar[0, 0]
            best = logits[0].max()
            if best - TIE > max(bar[0, 0], np.sort(logits[0])[-2]):
                certified += 1
                assert ids[0][logits[0].argmax()] == g.full_head(h)[0].argmax()
    assert certified > 0


def test_fused_certificate_rules():
    """The runtime's check of the graph's outputs: the margin over the runner-up and over the bar, NaN (outputs
    not written) never certified, and a candidate repeated (a short group's padding) never counted twice."""
    from types import SimpleNamespace

    from gpt2edge.runtime.sparse_head.fused import FusedReader

    r = FusedReader(SimpleNamespace(binding=None, switches={}), 4, 10)  # an OrtLM without IO binding
    assert not r.arm(1)  # no IO binding: the outputs are not fetched

    for ids, logits, bar, k, want in CERTIFICATE_CASES:
        r.ids, r.logits, r.bar = np.array([ids]), np.array([logits], dtype=float), np.array([[bar]], dtype=float)
        assert r.certified(0, k) == want, (ids, logits, bar, k)
