"""The certified step in one native call (gpt2edge/runtime/sparse_head/native.py, _certify.c): exact against
exact.py's arithmetic and the full head on random activations with most groups left out, the same outputs as the
body graph's own step, its extension (more rows read when the bar stops the best candidate) certifying more and
staying exact, the body graph's switch, the checks on its tables, and the library being built at all."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from gpt2edge.errors import ModelFolderError
from gpt2edge.runtime.generator import Generator
from gpt2edge.runtime.sparse_head import native
from gpt2edge.runtime.sparse_head.exact import TIE, HeadKernel
from tests.support.sparse_cases import CERTIFICATE_CASES, ONE_TWO, small_groups

needs_library = pytest.mark.skipif(native.LIBRARY is None, reason="the native step is not built")


def test_library_is_built_where_a_compiler_is():
    """The build is optional (an install without a compiler goes on), so a broken build would pass silently."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    if os.environ.get("GPT2EDGE_NATIVE") == "0":
        pytest.skip("turned off by GPT2EDGE_NATIVE=0")
    assert native.LIBRARY is not None, "run `pip install -e .`: it builds gpt2edge/runtime/sparse_head/_certify.c"


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("GPT2EDGE_NATIVE", "0")
    assert native._library() is None


@needs_library
def test_stale_build_refused(monkeypatch):
    """A library built from other sources (its interface version or struct size differ) is not used."""
    assert native._library() is not None
    monkeypatch.setattr(native, "ABI", native.ABI + 1)
    assert native._library() is None


def _small_groups(parent, g):
    """sparse_cases.small_groups for graph g's folder, its arrays as the native step takes them."""
    model, arrays = small_groups(parent, g.folder.dims.vocab_size, g.folder.dims.n_embd)
    return model, native.StepArrays(*(arrays[n] for n in native.STEP_ARRAYS[:4]), float(arrays["slack_coef"]))


@needs_library
@pytest.mark.parametrize("key", [("shared", "int8"), ("concat", "int4"), ("concat", "fp32")],
                         ids=["int8", "int4", "fp32"])  # fmt: skip
def test_native_step_is_exact(sparse_grid, tmp_path, key):
    """On random activations of several scales: without its extension the native step returns the graph's
    candidates, logits and bar; with it, its logits are exact.py's, its bar is above every row it did not return,
    a certified step's best is the full head's argmax (its k best the full head's for top-k), and it certifies more
    steps than the graph's step."""
    import onnx

    from gpt2edge.runtime.model.ort_session import create_session

    parent, folder = sparse_grid[key]
    g = Generator(folder).graph
    model, arrays = _small_groups(parent, g)
    onnx.save(model, str(tmp_path / "fused.onnx"))
    sess = create_session(tmp_path / "fused.onnx", threads=1)
    C = g.folder.dims.n_embd
    plain = native.NativeStep(g.table, arrays, g.rec.kind, 16, 4)
    plain._t.extra_rows = 0  # the graph's step, exactly
    ext = native.NativeStep(g.table, arrays, g.rec.kind, 16, 4)
    kernel = HeadKernel(g.table, g.rec.kind, C)
    rng = np.random.default_rng(5)
    counts = {"graph": 0, "extended": 0, "top-3": 0}
    for scale in (0.5, 2.0, 8.0, 32.0):
        for _ in range(8):
            h = (rng.standard_normal((1, C)) * scale).astype(np.float32)
            ids, logits, bar = sess.run(None, {"hidden": h})
            kernel.prepare(h[0])
            exact = kernel.full()
            full_best = int(g.full_head(h)[0].argmax())
            for label, step in (("graph", plain), ("extended", ext)):
                out = (np.zeros((1, 16), np.int64), np.zeros((1, 16)), np.zeros((1, 1)), np.zeros(1, np.int32))
                step.certify(h, *out)
                n_ids, n_logits, n_bar, read = out
                np.testing.assert_allclose(n_logits[0], exact[n_ids[0]], rtol=1e-6, atol=2e-5)
                assert np.delete(exact, n_ids[0]).max() <= n_bar[0, 0]
                best = n_logits[0].max()
                if best - TIE > max(n_bar[0, 0], np.sort(n_logits[0])[-2]):
                    counts[label] += 1
                    assert n_ids[0][n_logits[0].argmax()] == full_best
                if label == "graph":
                    assert read[0] == 16
                    assert set(n_ids[0]) == set(ids[0])
                    np.testing.assert_allclose(n_bar[0, 0], bar[0, 0], rtol=1e-5, atol=1e-5)
                else:
                    assert read[0] >= 16
            # top-k: the step reads on until the k-th best clears the bar; certified, the k best are the full head's
            out = (np.zeros((1, 16), np.int64), np.zeros((1, 16)), np.zeros((1, 1)), np.zeros(1, np.int32))
            ext.certify(h, *out, k=3)
            top = np.sort(out[1][0])[::-1]
            assert np.delete(exact, out[0][0]).max() <= out[2][0, 0]
            if top[2] - TIE > max(out[2][0, 0], top[3]):
                counts["top-3"] += 1
                assert set(out[0][0][np.argsort(out[1][0])[-3:]]) == set(np.argsort(exact)[-3:])
    assert counts["extended"] > counts["graph"] > 0 and counts["top-3"] > 0, counts


@needs_library
def test_float_kind_on_codes_is_exact(sparse_grid):
    """Kind "float" on a quantized table (MatMulNBits at accuracy level 0/1: dequantized rows times h in float):
    the native logits are exact.py's."""
    parent, folder = sparse_grid["concat", "int4"]
    g = Generator(folder).graph
    _, arrays = _small_groups(parent, g)
    step = native.NativeStep(g.table, arrays, "float", 16, 4)
    kernel = HeadKernel(g.table, "float", g.folder.dims.n_embd)
    h = (np.random.default_rng(2).standard_normal((3, g.folder.dims.n_embd)) * 4).astype(np.float32)
    out = (np.zeros((3, 16), np.int64), np.zeros((3, 16)), np.zeros((3, 1)), np.zeros(3, np.int32))
    step.certify(h, *out)
    for b in range(3):
        kernel.prepare(h[b])
        exact = kernel.full()
        np.testing.assert_allclose(out[1][b], exact[out[0][b]], rtol=1e-9, atol=1e-9)
        assert np.delete(exact, out[0][b]).max() <= out[2][b, 0]


@needs_library
def test_outputs_are_checked(sparse_grid):
    g = Generator(sparse_grid["shared", "int8"][1]).graph
    step = native.NativeStep(g.table, g.step_arrays, g.rec.kind, g.fused_k, g.rec.groups)
    K, C = g.fused_k, g.folder.dims.n_embd
    ok = (np.zeros((2, K), np.int64), np.zeros((2, K)), np.zeros((2, 1)), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="outputs"):
        step.certify(np.zeros((2, C), np.float32), ok[0], ok[1].astype(np.float32), ok[2], ok[3])
    with pytest.raises(ValueError, match="rows"):
        step.certify(np.zeros((3, C), np.float32), *ok)  # more rows than the outputs hold
    h = np.ones((2, C), np.float32)
    h[0, 3], h[1, 5] = np.inf, np.nan  # a diverged model: nothing certified, no crash
    step.certify(h, *ok)
    assert np.isnan(ok[2]).all() and (ok[0] == 0).all()


def test_body_graph_switches(sparse_grid):
    """The sparse body's own step sits behind If(sparse_step) and a copy of the full head behind
    If(sparse_skip_head): the step off returns the NaN placeholders (nothing of it runs), on a real bar; the head
    on returns the head graph's log-probs bit for bit, off a (1, 1) placeholder. OrtGraph feeds bool inputs True."""
    from gpt2edge.runtime.sparse_head.fused import BAR, FULL_OUTPUT, HEAD_SWITCH, IDS, STEP_INPUT

    g = Generator(sparse_grid["concat", "int8"][1]).graph
    body = g.body
    assert STEP_INPUT in body.switches and HEAD_SWITCH in body.switches
    feed = {"input_ids": np.array([[5, 6]]), "attention_mask": np.ones((1, 2), np.int64),
            "position_ids": np.array([[0, 1]])}  # fmt: skip
    past = np.zeros((1, body.n_head, 0, body.head_dim), np.float32)
    feed.update((name, past) for name in body.past_names)

    def run(step: bool, skip_head: bool):
        flags = {STEP_INPUT: np.array(step), HEAD_SWITCH: np.array(skip_head)}
        return body.session.run(["hidden", IDS, BAR, FULL_OUTPUT], {**feed, **flags})

    h, ids, bar, lp = run(True, False)
    assert np.isfinite(bar).all() and ids.shape == (1, g.fused_k)
    np.testing.assert_array_equal(lp, g.full_head(h))  # the same nodes on the same weights
    _, _, bar, lp = run(False, True)
    assert np.isnan(bar).all() and lp.shape == (1, 1)


def test_step_tables_are_checked(sparse_grid, tmp_path):
    """The .npz's step arrays: absent (an older folder) -> None, the graph's own step; malformed -> one error."""
    folder = sparse_grid["shared", "int8"][1]
    g = Generator(folder).graph
    V, C, r = g.folder.dims.vocab_size, g.folder.dims.n_embd, g.rec.rank
    with np.load(g.table_path) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(tmp_path / "old.npz", **{k: v for k, v in arrays.items() if k not in native.STEP_ARRAYS})
    assert native.load_step_arrays(tmp_path / "old.npz", V, C, r) is None
    bad = dict(arrays, member_rows=arrays["member_rows"][:, :-1])
    np.savez(tmp_path / "bad.npz", **bad)
    with pytest.raises(ModelFolderError, match="malformed"):
        native.load_step_arrays(tmp_path / "bad.npz", V, C, r)
    out_of_range = dict(arrays, group_members=arrays["group_members"] + V)
    np.savez(tmp_path / "range.npz", **out_of_range)
    with pytest.raises(ModelFolderError, match="malformed"):
        native.load_step_arrays(tmp_path / "range.npz", V, C, r)


@needs_library
def test_native_certificate_rules(sparse_grid):
    """The native check (g2e_rows) takes the same decisions as FusedReader.certified: the margin over the runner-up
    and the bar, NaN never certified, a repeated candidate never counted twice; and writes the rows the same way."""
    from types import SimpleNamespace

    g = Generator(sparse_grid["shared", "int8"][1]).graph
    step = native.NativeStep(g.table, g.step_arrays, g.rec.kind, 4, 1)
    V = 10
    r = SimpleNamespace(V=V, ok=np.zeros(1, np.int8), rows=np.full((1, V), -np.inf, np.float32),
                        last=np.zeros((1, 4), np.int64), last_ok=np.zeros(1, np.int8))  # fmt: skip

    def check(ids, logits, bar, k):
        r.ids, r.logits, r.bar = np.array([ids]), np.array([logits], dtype=float), np.array([[bar]], dtype=float)
        step.rows(r, 1, k)
        return bool(r.ok[0])

    for ids, logits, bar, k, want in CERTIFICATE_CASES:
        assert check(ids, logits, bar, k) == want, (ids, logits, bar, k)
    # the rows written: -inf but at the candidates, shifted so the best is 0; the ids written before are reset
    assert check([3, 4, 5, 7], ONE_TWO, 3.0, 1)
    np.testing.assert_array_equal(np.flatnonzero(np.isfinite(r.rows[0])), [3, 4, 5, 7])
    assert r.rows[0, 3] == 0.0 and r.rows[0, 4] == -1.0
    assert check([1, 2, 5, 7], ONE_TWO, 3.0, 1)
    np.testing.assert_array_equal(np.flatnonzero(np.isfinite(r.rows[0])), [1, 2, 5, 7])


def test_threads_share_one_folder(sparse_grid):
    """Generations in several threads on one loaded sparse folder: each LM has its own native step (scratch,
    cached addresses) and reader, so each thread gets the tokens it gets alone, and the shared counters add up."""
    from concurrent.futures import ThreadPoolExecutor

    g = Generator(sparse_grid["shared", "int4"][1])
    prompts = ["The river rose and", "A quiet", "Once upon", "In the"] * 2
    kw = dict(max_new_tokens=24, ignore_eos=True)
    alone = [g.generate(p, **kw).token_ids for p in prompts]
    g.graph.reset_stats()
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: g.generate(p, **kw).token_ids, prompts))
    assert together == alone
    st = g.graph.stats
    assert st.steps == 24 * len(prompts) and st.certified + st.fallbacks + st.skipped + st.full == st.steps
