"""The approximate sparse head (`gpt2edge sparse-head --mode cluster`): with every cluster probed it is the full
head (fp32 / int8 / int4, log-probs within 1e-4); with fewer it is not, and its make-time report measures how far;
its folders are labelled, its table is checksummed, its options are range-checked, and what would pass its rows
off as the model's log-probs is refused with one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from gpt2edge.errors import ChecksumError, GenerationError, ModelFolderError
from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.generator import Generator
from tests.support import cli, one_error_line

TEXT = "def read(path):\n    with open(path) as f:\n        return f.read()\n" * 6


@pytest.fixture(scope="module")
def folders(tiny_export, tiny_export_shared, tmp_path_factory) -> dict:
    """precision -> (parent, all clusters probed, 2 of 16 probed); fp32 on the concat cache, int8 / int4 on the
    shared one (both graph kinds)."""
    from gpt2edge.quantize.handler import make_recipe, quantize_model
    from gpt2edge.sparse.approx_handler import cluster_sparse_head

    root = tmp_path_factory.mktemp("approx")
    out = {}
    for p in ("fp32", "int8", "int4"):
        parent = tiny_export if p == "fp32" else root / p
        if p != "fp32":
            quantize_model(tiny_export_shared, parent, make_recipe(p), report=False)
        every = root / f"{p}-all"
        some = root / f"{p}-some"
        cluster_sparse_head(parent, every, clusters=16, probe=16, text=TEXT, report_tokens=64, log=None)
        cluster_sparse_head(parent, some, clusters=16, probe=2, text=TEXT, report_tokens=64, log=None)
        out[p] = parent, every, some
    return out


def forced_rows(folder, ids, configure: bool = True) -> np.ndarray:
    """(T, V) rows of a folder's LM along ids, one cached step a token (the generate path)."""
    lm = Generator(folder).graph.new_lm()
    lm.start(1, len(ids))
    if configure and hasattr(lm, "configure_head"):
        lm.configure_head(SamplingParams())
    mask = np.ones((1, len(ids)), dtype=np.int64)
    return np.stack([
        np.array(lm.forward(np.array([[t]]), mask[:, : i + 1], np.array([[i]]))[0]) for i, t in enumerate(ids)
    ])  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_all_clusters_probed_is_the_full_head(folders, precision):
    parent, every, some = folders[precision]
    ids = Generator(parent).tokenizer.encode(TEXT)[:24]
    full, same, approx = forced_rows(parent, ids), forced_rows(every, ids), forced_rows(some, ids)
    np.testing.assert_allclose(same, full, atol=1e-4)
    assert np.abs(approx - full).max() > 1e-2  # 2 of 16 probed: a different distribution (the check can fail)
    # each row is still a distribution over every token (the tail is estimated, not dropped)
    np.testing.assert_allclose(np.exp(approx.astype(np.float64)).sum(-1), 1, atol=1e-4)
    assert np.isfinite(approx).all()


def test_report_is_measured(folders):
    _, every, some = folders["int8"]
    qa = json.loads((every / "manifest.json").read_text())["quality"]
    qs = json.loads((some / "manifest.json").read_text())["quality"]
    assert qa["mean_kl"] < 1e-6 and qa["top1_agreement"] == 1.0
    assert qa["perplexity_variant"] == pytest.approx(qa["perplexity_reference"], rel=1e-4)
    assert qs["mean_kl"] > 1e-3 and qs["max_kl"] >= qs["mean_kl"] and 0 <= qs["top1_agreement"] <= 1
    assert qs["perplexity_variant"] != qs["perplexity_reference"] and qs["tokens"] == 64
    rec = json.loads((some / "manifest.json").read_text())["sparse_head"]
    assert qs["rows_read_per_step"] == rec["rows_per_step"] == 2 * rec["cluster_size"]
    assert qa["rows_read_per_step"] == 16 * rec["cluster_size"] >= rec["rows_per_step"]


def test_labelled_and_refused(folders):
    _, _, some = folders["int4"]
    rec = json.loads((some / "manifest.json").read_text())["sparse_head"]
    assert rec["approximate"] is True and rec["mode"] == "cluster" and rec["tail"] == "cluster-mean"
    gen = Generator(some)
    r = gen.generate("def f(x):", max_new_tokens=6, ignore_eos=True)
    assert r.head == {"approximate": True, "mode": "cluster", "clusters": 16, "probe": 2,
                      "rows_per_step": rec["rows_per_step"]}  # fmt: skip
    assert r.to_json()["head"]["approximate"] is True
    assert "".join(gen.stream("def f(x):", max_new_tokens=6, ignore_eos=True)) == r.text
    batch = gen.generate(["def f(x):", "import os"], max_new_tokens=4, ignore_eos=True)
    assert [len(b.token_ids) for b in batch] == [4, 4] and all(b.head["approximate"] for b in batch)
    sess = gen.session()
    assert sess.generate("def f(x):", max_new_tokens=3, ignore_eos=True).head["approximate"]
    kw = dict(max_new_tokens=6, ignore_eos=True, do_sample=True, top_p=0.9, temperature=0.8, seed=1)
    assert gen.generate("x", **kw).token_ids == gen.generate("x", **kw).token_ids  # seeded sampling works
    with pytest.raises(GenerationError, match="logprobs"):
        gen.generate("def f(x):", max_new_tokens=3, logprobs=2)
    with pytest.raises(GenerationError, match="approximate"):
        gen.generate("def f(x):", max_new_tokens=3, num_beams=2)
    with pytest.raises(GenerationError, match="approximate"):
        forced_rows(some, [1, 2, 3], configure=False)  # scoring / parity loops never configure the head
    parent, _, _ = folders["int4"]
    assert Generator(parent).generate("def f(x):", max_new_tokens=2).head is None  # other folders: no label
    out = cli("generate", some, "-p", "def f(x):", "-n", "2", "--json")
    assert out.exit_code == 0 and "approximate LM head" in out.output


def test_tampered_table_refused(folders, tmp_path):
    _, _, some = folders["fp32"]
    bad = tmp_path / "bad"
    shutil.copytree(some, bad)
    data = bytearray((bad / "approx.onnx").read_bytes())
    data[-200] ^= 0xFF  # a byte of the tables (initializers) flipped
    (bad / "approx.onnx").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="checksum"):
        Generator(bad)
    one_error_line(cli("generate", bad, "-p", "Hi", "-n", "2"), "checksum")
    m = json.loads((some / "manifest.json").read_text())
    m["sparse_head"]["probe"] = 17  # more than its 16 clusters
    shutil.copytree(some, tmp_path / "rec")
    (tmp_path / "rec" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ModelFolderError, match="probe"):
        Generator(tmp_path / "rec", verify=False)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--mode", "cluster", "--clusters", "300"], "--clusters"),  # over half the tiny model's 400 tokens
        (["--mode", "cluster", "--clusters", "8", "--probe", "9"], "--probe"),
        (["--mode", "cluster", "--probe", "300"], "--probe"),  # over the default's 200 clusters
        (["--mode", "cluster", "--rank", "4"], "--rank"),
        (["--clusters", "8"], "--mode cluster"),
        (["--probe", "2", "--no-report"], "--mode cluster"),
    ],
)
def test_options_out_of_range(tiny_export, tmp_path, args, match):
    """Bounds that depend on the folder: one `error:` line, exit 1, nothing written."""
    one_error_line(cli("sparse-head", tiny_export, "-o", tmp_path / "o", *args), match)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args",
    [["--clusters", "1"], ["--clusters", "5000"], ["--probe", "0"], ["--report-tokens", "1"], ["--clusters", "x"]],
)
def test_fixed_ranges_are_usage_errors(tiny_export, tmp_path, args):
    r = cli("sparse-head", tiny_export, "-o", tmp_path / "o", "--mode", "cluster", *args)
    assert r.exit_code == 2 and args[0] in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_modes_agree():
    from gpt2edge.runtime.sparse_head.approx import MODES
    from gpt2edge.sparse.modes import SPARSE_MODES

    assert SPARSE_MODES == ("exact", *MODES)


def test_approximate_folder_is_not_a_parent(folders, tmp_path):
    _, _, some = folders["fp32"]
    one_error_line(cli("sparse-head", some, "-o", tmp_path / "a", "--mode", "cluster"), "already has a sparse head")
    one_error_line(cli("sparse-head", some, "-o", tmp_path / "b"), "already has a sparse head")


@pytest.mark.parametrize("which", [2, 0], ids=["approximate", "parent"])
def test_served_responses_are_labelled(folders, which):
    """A server on an approximate folder says so on every /v1 response (X-Gpt2edge-Head) and in its model
    card; a server on any other folder does not."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")
    from gpt2edge.serve import ServeConfig
    from gpt2edge.serve.api.app import create_app
    from gpt2edge.serve.hosting.server import BackgroundServer
    from gpt2edge.serve.scheduling.continuous import make_scheduler

    folder = folders["int4"][which]
    config = ServeConfig(model_name="t")
    scheduler = make_scheduler(Generator(folder), config)
    with BackgroundServer(create_app(lambda: scheduler, config)) as url:
        body = {"model": "t", "prompt": "def f(x):", "max_tokens": 3}
        plain = httpx.post(url + "/v1/completions", json=body, timeout=60)
        streamed = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        health = httpx.get(url + "/health", timeout=30)
    assert plain.status_code == streamed.status_code == 200 and plain.json()["choices"][0]["text"] is not None
    assert "x-gpt2edge-head" not in health.headers  # operators' endpoints are not model output
    if which == 0:
        assert "x-gpt2edge-head" not in plain.headers and "approximate_head" not in card
        return
    rec = json.loads((folder / "manifest.json").read_text())["sparse_head"]
    label = f"approximate; mode=cluster; clusters=16; probe=2; rows_per_step={rec['rows_per_step']}"
    assert plain.headers["x-gpt2edge-head"] == streamed.headers["x-gpt2edge-head"] == label
    assert card["approximate_head"]["approximate"] is True and card["approximate_head"]["probe"] == 2
