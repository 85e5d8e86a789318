"""--kv-dtype fp16|int8: a compact KV cache for both graph kinds (gpt2edge.quantize.kv), against the float32 cache.

Stated tolerances (the tiny seeded random model, fp32 weights, the built-in sample text): an fp16 cache keeps
greedy ids and moves a scored log-prob by < 0.01; an int8 cache (static per-channel scales) agrees on >= 95 % of
the top-1 tokens with mean KL < 1e-3 and moves a scored log-prob by < 0.3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.errors import ConvertError, ExportError, QuantizeError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.memory_plan import generation_estimate
from gpt2edge.runtime.open_model import load_graph
from gpt2edge.runtime.score import Scorer

KINDS = ("concat", "shared")
DTYPES = {"fp16": "float16", "int8": "int8"}
PROMPTS = ["The history of the city", "Farmers brought grain"]
N_NEW = 16


@pytest.fixture(scope="module")
def compact(tiny_checkpoint, tmp_path_factory) -> dict[tuple[str, str], Path]:
    from gpt2edge.export import export_model

    root = tmp_path_factory.mktemp("kv")
    out = {}
    for kind in KINDS:
        for choice in DTYPES:
            out[kind, choice] = export_model(
                str(tiny_checkpoint), root / f"{kind}-{choice}", kv_cache=kind, kv_dtype=choice, log=None
            ).path
    return out


@pytest.fixture(scope="module")
def fp32(tiny_export, tiny_export_shared) -> dict[str, Path]:
    return {"concat": tiny_export, "shared": tiny_export_shared}


def score(folder: Path, text: str):
    """Token-by-token scoring through the folder's KV cache."""
    return Scorer(ModelFolder.open(folder, verify=False)).score(text)


def past_types(folder: Path) -> set[int]:
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return {i.type.tensor_type.elem_type for i in m.graph.input if i.name.startswith("past_key_values.")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("choice", DTYPES)
def test_manifest_and_graph_record_the_cache_and_its_effect(compact, kind, choice):
    folder = compact[kind, choice]
    m = json.loads((folder / "manifest.json").read_text())
    dtype = DTYPES[choice]
    assert m["graph"]["kv_dtype"] == dtype and m["graph"]["kv_cache"] == kind
    assert {t["dtype"] for t in m["graph"]["inputs"] if t["name"].startswith("past_key_values.")} == {dtype}
    assert {t["dtype"] for t in m["graph"]["outputs"] if t["name"].startswith("present.")} == {dtype}
    assert past_types(folder) == {onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))}
    assert (m["graph"].get("kv_quantization") is not None) == (choice == "int8")
    effect = m["kv_effect"]
    assert effect["kv_dtype"] == dtype and effect["reference"].endswith("float32 KV cache")
    if choice == "fp16":
        assert effect["top1_agreement"] == 1.0 and effect["mean_kl"] < 1e-5
    else:
        assert effect["top1_agreement"] >= 0.95 and 0 < effect["mean_kl"] < 1e-3
    assert not list(folder.parent.glob(f".{folder.name}*"))  # the float32-cache twin is gone


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("choice", DTYPES)
def test_generation_against_the_float32_cache(compact, fp32, kind, choice):
    ref, var = Generator(fp32[kind]), Generator(compact[kind, choice])
    for prompt in PROMPTS:
        a = ref.generate(prompt, max_new_tokens=N_NEW, do_sample=False, ignore_eos=True, logprobs=0)
        b = var.generate(prompt, max_new_tokens=N_NEW, do_sample=False, ignore_eos=True, logprobs=0)
        if choice == "fp16":
            assert b.token_ids == a.token_ids  # greedy ids identical
        # the fp32 cache's greedy text scored by both: log-prob deltas within the stated bound
        sa, sb = score(fp32[kind], prompt + a.text), score(compact[kind, choice], prompt + a.text)
        delta = np.abs(np.asarray(sa.token_logprobs[1:]) - np.asarray(sb.token_logprobs[1:])).max()
        assert delta < (0.01 if choice == "fp16" else 0.3), delta


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("choice", DTYPES)
def test_io_binding_and_the_in_place_cache_are_kept(compact, kind, choice):
    lm = load_graph(ModelFolder.open(compact[kind, choice], verify=False)).new_lm()
    assert lm.io_binding
    lm.start(1, 32)
    mask = np.ones((1, 32), np.int64)
    for t in range(20):
        lm.forward(np.array([[t + 5]], np.int64), mask[:, : t + 1], np.array([[t]], np.int64))
    storage = lm.cache._storage
    assert storage.dtype == np.dtype(DTYPES[choice])
    assert lm.cache.allocations == 1
    if kind == "shared":  # the graph wrote the 20 entries into the bound buffer itself
        assert np.any(storage[0, 0, :, 19] != 0) and not np.any(storage[0, 0, :, 20:])


def test_concat_and_shared_int8_quantize_alike(compact):
    """The concat graph's in-graph quantization is GroupQueryAttention's own (same codes, same scales)."""
    a = score(compact["concat", "int8"], PROMPTS[0] + " and the old castle")
    b = score(compact["shared", "int8"], PROMPTS[0] + " and the old castle")
    np.testing.assert_allclose(a.token_logprobs[1:], b.token_logprobs[1:], atol=1e-4)


def test_memory_plan_server_rows_and_bench_count_the_smaller_cache(compact, fp32):
    from gpt2edge.bench.bench import kv_bytes_per_step

    for kind in KINDS:
        full = ModelFolder.open(fp32[kind], verify=False)
        kv = {c: ModelFolder.open(compact[kind, c], verify=False) for c in DTYPES}

        def cache_bytes(folder):
            return dict(generation_estimate(folder, [[0] * 8], 100, num_beams=2).parts)

        key = next(k for k in cache_bytes(full) if k.startswith("KV cache"))
        assert cache_bytes(kv["fp16"])[key] * 2 == cache_bytes(full)[key]
        assert cache_bytes(kv["int8"])[key] * 4 == cache_bytes(full)[key]
        assert np.dtype(kv["int8"].kv_dtype).itemsize == 1
    d = {"n_layer": 2, "n_head": 2, "head_dim": 8}
    assert kv_bytes_per_step(d, 1, 10, 1) * 4 == kv_bytes_per_step(d, 1, 10, 4)


def test_quantize_kv_dtype_int8_on_an_int8_variant(tiny_export, tmp_path):
    result = CliRunner().invoke(
        main, ["quantize", str(tiny_export), "-o", str(tmp_path / "q"), "--mode", "int8", "--kv-dtype", "int8"]
    )
    assert result.exit_code == 0, result.output
    assert "KV cache int8 vs float32 (same weights)" in result.output
    m = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert m["graph"]["precision"] == "int8" and m["graph"]["kv_dtype"] == "int8"
    assert m["kv_effect"]["top1_agreement"] >= 0.9 and m["quality"]["top1_agreement"] > 0.5
    r = Generator(tmp_path / "q").generate(PROMPTS[0], max_new_tokens=8, do_sample=False, ignore_eos=True)
    assert len(r.token_ids) == 8


def one_line_error(result, phrase: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert phrase in result.stderr, result.stderr


def test_kv_dtype_where_it_cannot_run_is_refused_in_one_line(tiny_checkpoint, tiny_export, compact, tmp_path):
    run = CliRunner().invoke
    out = tmp_path / "out"
    one_line_error(
        run(main, ["export", "-m", str(tiny_checkpoint), str(out), "--static", "1x4x32", "--kv-dtype", "int8"]),
        "--kv-dtype int8 cannot be combined",
    )
    one_line_error(
        run(main, ["quantize", str(tiny_export), "-o", str(out), "--mode", "fp16", "--kv-dtype", "int8"]),
        "--mode fp16 keeps the KV cache in float16",
    )
    one_line_error(
        run(main, ["quantize", str(compact["concat", "int8"]), "-o", str(out), "--mode", "int4", "--kv-dtype", "fp16"]),
        "already has a int8 KV cache",
    )
    one_line_error(
        run(main, ["quantize", str(compact["concat", "fp16"]), "-o", str(out), "--mode", "fp16"]),
        "already has a float16 KV cache",
    )
    one_line_error(
        run(main, ["convert", str(compact["shared", "int8"]), "-o", str(out), "--format", "genai"]),
        "use --format ort",
    )
    for choice in DTYPES:
        one_line_error(
            run(main, ["convert", str(compact["concat", choice]), "-o", str(out), "--format", "web"]),
            "--kv-dtype fp32",
        )
    assert not out.exists()
    with pytest.raises(ExportError, match="Unknown --kv-dtype"):
        from gpt2edge.export import export_model

        export_model(str(tiny_checkpoint), out, kv_dtype="int4")
    with pytest.raises(QuantizeError, match="Unknown --kv-dtype"):
        from gpt2edge.quantize import make_recipe, quantize_model

        quantize_model(tiny_export, out, make_recipe("int8"), kv_dtype="int4")
    assert ConvertError  # the convert refusals above are ConvertErrors


def test_genai_takes_an_fp16_cache(compact, tmp_path):
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed")
    from gpt2edge.convert import convert_folder

    convert_folder(compact["concat", "fp16"], tmp_path / "g", "genai")
    ours = Generator(compact["concat", "fp16"])
    r = ours.generate(PROMPTS[0], max_new_tokens=N_NEW, do_sample=False, ignore_eos=True)
    model = og.Model(str(tmp_path / "g"))
    params = og.GeneratorParams(model)
    n = len(r.prompt_token_ids) + N_NEW
    params.set_search_options(do_sample=False, max_length=n, min_length=n)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(r.prompt_token_ids, dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    assert [int(t) for t in gen.get_sequence(0)[len(r.prompt_token_ids) :]] == r.token_ids


def test_server_admits_more_rows_with_a_smaller_cache(compact, fp32, monkeypatch):
    from types import SimpleNamespace

    from gpt2edge.serve.scheduling import rows

    full = ModelFolder.open(fp32["concat"], verify=False)
    small = ModelFolder.open(compact["concat", "int8"], verify=False)
    per_row = generation_estimate(full, [[0]], full.n_positions).total
    monkeypatch.setattr(rows, "available_bytes", lambda: int(4.5 * per_row / rows.SHARE))
    n_full, _ = rows.serving_rows(SimpleNamespace(lm=SimpleNamespace(batch=None), folder=full), None)
    n_small, why = rows.serving_rows(SimpleNamespace(lm=SimpleNamespace(batch=None), folder=small), None)
    assert n_full == 4 and n_small >= 3 * n_full and why == rows.MEMORY


@pytest.mark.parametrize("kind", KINDS)
def test_quantizing_a_compact_export_keeps_its_cache(compact, kind, tmp_path):
    from gpt2edge.quantize import make_recipe, quantize_model

    m = quantize_model(compact[kind, "int8"], tmp_path / "q", make_recipe("int4"), report=False)
    assert m["graph"]["kv_dtype"] == "int8" and m["graph"]["kv_quantization"]["granularity"] == "per-tensor"
    assert past_types(tmp_path / "q") == {onnx.TensorProto.INT8}
    a = score(compact[kind, "int8"], PROMPTS[0] + " and the old castle")
    b = score(tmp_path / "q", PROMPTS[0] + " and the old castle")
    assert np.all(np.isfinite(b.token_logprobs[1:])) and len(b.token_logprobs) == len(a.token_logprobs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_session_restores_a_compact_cache(compact, fp32, kind, tmp_path):
    gen = Generator(compact[kind, "int8"])
    greedy = dict(ignore_eos=True, do_sample=False, max_new_tokens=8)
    a = gen.session()
    a.generate(PROMPTS[0], **greedy)
    path = a.save(tmp_path / "s.g2s")
    want = a.generate(" and then", **greedy).token_ids
    b = gen.session()
    b.load(path)
    assert b.generate(" and then", **greedy).token_ids == want
    full = gen_session_file(fp32[kind], tmp_path / "f.g2s", greedy)
    assert path.stat().st_size < full.stat().st_size / 3  # one byte per cached entry, not four


def gen_session_file(folder: Path, path: Path, greedy: dict) -> Path:
    s = Generator(folder).session()
    s.generate(PROMPTS[0], **greedy)
    return s.save(path)
