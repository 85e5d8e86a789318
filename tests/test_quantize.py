"""Quantized variants: they run, meet stated quality thresholds against fp32, shrink the file, and refuse
bad requests. Thresholds (also in the README) are for the tiny seeded test model, measured with ~3x margin:

| mode | mean KL(fp32 || variant) | top-1 agreement | max |Δ logprob| |
| fp16 | <= 1e-4                  | >= 0.99         | <= 5e-2          |
| int8 | <= 5e-3                  | >= 0.95         |                  |
| int4 | <= 0.3                   | >= 0.5          |                  |
A broken quantizer (wrong packing, wrong scales) gives KL > 1 on this model.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

from gpt2edge.cli import main
from gpt2edge.errors import QuantizeError
from gpt2edge.manifest import digest_folder, read_manifest
from gpt2edge.quality import compare_folders
from gpt2edge.quantize import make_recipe, quantize_model
from gpt2edge.quantize.primitives import dequantize_blockwise, quantize_blockwise
from gpt2edge.runtime import Generator

THRESHOLDS = {
    "fp16": {"mean_kl": 1e-4, "top1": 0.99, "max_logprob_diff": 5e-2},
    "int8": {"mean_kl": 5e-3, "top1": 0.95},
    "int4": {"mean_kl": 0.3, "top1": 0.5},
}


@pytest.fixture(scope="module")
def variants(tiny_export, tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return {mode: _quantize(tiny_export, root / mode, mode) for mode in ("fp16", "int8", "int4")}


def _quantize(src, out, mode, **kw):
    quantize_model(src, out, make_recipe(mode, **kw))
    return out


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_variant_generates_and_meets_thresholds(variants, mode):
    folder = variants[mode]
    manifest = read_manifest(folder)
    q = manifest["quality"]
    limits = THRESHOLDS[mode]
    assert q["mean_kl"] <= limits["mean_kl"], q
    assert q["top1_agreement"] >= limits["top1"], q
    if "max_logprob_diff" in limits:
        assert q["max_abs_logprob_diff"] <= limits["max_logprob_diff"], q
    r = Generator(folder).generate("The river", max_new_tokens=8, ignore_eos=True)
    assert len(r.token_ids) == 8
    assert manifest["graph"]["precision"] == mode


def test_fp16_has_half_cache_and_float_logprobs(variants):
    g = Generator(variants["fp16"])
    assert g.lm.cache.dtype == np.float16
    sess = g.lm.session
    assert sess.get_outputs()[0].type == "tensor(float)"
    assert sess.get_inputs()[3].type == "tensor(float16)"
    assert read_manifest(variants["fp16"])["graph"]["kv_dtype"] == "float16"
    g.generate("The river", max_new_tokens=6, ignore_eos=True)
    assert g.lm.cache.allocations == 1


def test_manifest_records_recipe_parent_and_sizes(variants, tiny_export):
    parent = read_manifest(tiny_export)
    m = read_manifest(variants["int4"])
    q = m["quantization"]
    assert q["recipe"]["mode"] == "int4" and q["recipe"]["block_size"] == 32 and q["recipe"]["head_bits"] == 8
    assert q["parent"]["sha256"]["model.onnx"] == parent["files"]["model.onnx"]["sha256"]
    assert q["size_before"] == parent["files"]["model.onnx"]["size"]
    assert q["size_after"] == m["files"]["model.onnx"]["size"]
    assert m["files"] == digest_folder(variants["int4"])
    assert m["quality"]["greedy_tokens"] == 64


def test_input_folder_is_never_modified(tiny_export, tmp_path):
    before = digest_folder(tiny_export)
    _quantize(tiny_export, tmp_path / "q", "int8")
    assert digest_folder(tiny_export) == before


def test_report_is_computed_not_copied(variants, tmp_path):
    """Corrupt one weight block of the int8 variant: its KL against fp32 must rise."""
    corrupted = tmp_path / "corrupt"
    shutil.copytree(variants["int8"], corrupted)
    model = onnx.load(str(corrupted / "model.onnx"))
    scales = next(i for i in model.graph.initializer if i.name == "h.0.mlp.c_fc.weight.scales")
    arr = numpy_helper.to_array(scales).copy()
    arr[:, :] *= 8.0  # one matrix's scales blown up
    scales.CopyFrom(numpy_helper.from_array(arr, scales.name))
    onnx.save(model, str(corrupted / "model.onnx"))
    fp32 = read_manifest(variants["int8"])["quantization"]["parent"]["path"]
    good = compare_folders(fp32, variants["int8"])
    bad = compare_folders(fp32, corrupted)
    assert bad["mean_kl"] > 10 * good["mean_kl"]
    assert good["mean_kl"] == pytest.approx(read_manifest(variants["int8"])["quality"]["mean_kl"], rel=1e-6)


@pytest.fixture(scope="module")
def wide_export(tmp_path_factory):
    """A model whose weight matrices dominate its size (n_embd 256, small vocab and context)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2edge.export import export_model
    from gpt2edge.export.random_checkpoint import train_tokenizer

    root = tmp_path_factory.mktemp("wide")
    tok = train_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tok), n_layer=2, n_head=4, n_embd=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    GPT2LMHeadModel(cfg).save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    export_model(str(root / "ckpt"), root / "fp32", run_validation=False)
    return root / "fp32"


@pytest.mark.parametrize("mode, limit", [("int8", 0.30), ("int4", 0.20)])
def test_file_size_ratio(wide_export, tmp_path, mode, limit):
    quantize_model(wide_export, tmp_path / mode, make_recipe(mode), report=False)
    ratio = read_manifest(tmp_path / mode)["quantization"]["ratio"]
    assert ratio <= limit, f"{mode} file is {ratio:.1%} of fp32"


def test_tied_table_stored_once_and_keep_head_fp32(variants, tiny_export, tmp_path):
    vocab = read_manifest(tiny_export)["dims"]["vocab_size"]
    model = onnx.load(str(variants["int8"] / "model.onnx"))
    big = [i.name for i in model.graph.initializer if i.dims and i.dims[0] == vocab and len(i.dims) == 3]
    assert big == ["wte.weight.q8"]  # packed once, read by the head MatMulNBits and the embedding Gather
    assert not any(i.name == "wte.weight" for i in model.graph.initializer)
    out = _quantize(tiny_export, tmp_path / "keep", "int8", keep_head_fp32=True)
    kept = onnx.load(str(out / "model.onnx"))
    assert any(n.op_type == "Gemm" for n in kept.graph.node)
    assert any(i.name == "wte.weight" for i in kept.graph.initializer)
    Generator(out).generate("The", max_new_tokens=4)


def _zero_point_tables(folder) -> list[str]:
    return [i.name for i in onnx.load(str(folder / "model.onnx")).graph.initializer if "zero_points" in i.name]


def test_int4_symmetric_by_default_int8_asymmetric(variants, tiny_export, tmp_path):
    """int4 stores no zero points (Q4_0's form, the faster kernel here), int8 does; both can be switched."""
    recipe = {m: read_manifest(variants[m])["quantization"]["recipe"] for m in ("int8", "int4")}
    assert recipe["int4"]["symmetric"] is True and recipe["int8"]["symmetric"] is False
    assert _zero_point_tables(variants["int4"]) == []
    assert "h.0.mlp.c_fc.weight.zero_points" in _zero_point_tables(variants["int8"])
    out = tmp_path / "int4-asym"
    r = quantize_cli(tiny_export, "-o", out, "--mode", "int4", "--asymmetric", "--no-report")
    assert r.exit_code == 0, r.output
    assert read_manifest(out)["quantization"]["recipe"]["symmetric"] is False
    assert "h.0.mlp.c_fc.weight.zero_points" in _zero_point_tables(out)
    # the asymmetric form's quality, through the same report as the default's
    q = compare_folders(tiny_export, out)
    assert q["mean_kl"] <= THRESHOLDS["int4"]["mean_kl"] and q["top1_agreement"] >= THRESHOLDS["int4"]["top1"]
    sym8 = tmp_path / "int8-sym"
    assert quantize_cli(tiny_export, "-o", sym8, "--mode", "int8", "--symmetric", "--no-report").exit_code == 0
    assert _zero_point_tables(sym8) == []  # embedding rows too: dequantized around the fixed mid code
    g = Generator(sym8).generate("The river", max_new_tokens=6, ignore_eos=True)
    assert len(g.token_ids) == 6
    assert compare_folders(tiny_export, sym8)["mean_kl"] <= THRESHOLDS["int8"]["mean_kl"]


def test_int4_head_bits_4(tiny_export, tmp_path):
    out = _quantize(tiny_export, tmp_path / "h4", "int4", head_bits=4)
    assert read_manifest(out)["quantization"]["recipe"]["head_bits"] == 4
    Generator(out).generate("The", max_new_tokens=4)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K", [64, 80])  # 80: K not a multiple of the block, padded
def test_primitives_match_the_kernel(bits, K, symmetric):
    rng = np.random.default_rng(bits + K)
    w = rng.standard_normal((K, 24)).astype(np.float32)
    q = quantize_blockwise(w, bits, 32, symmetric)
    assert (q.zero_points is None) == symmetric
    deq = dequantize_blockwise(q)
    # within half a step; symmetric: one step at most (the code range is one longer on the side of the block's
    # largest |w|, so the opposite extreme clips by up to a step, as in llama.cpp's Q4_0); scales carry a sign
    step = np.abs(q.scales).max()
    assert np.abs(deq - w).max() <= step * (1.01 if symmetric else 0.51) + 1e-6
    arrays = [("B", q.packed), ("S", q.scales)] + ([] if symmetric else [("Z", q.zero_points)])
    node = helper.make_node(
        "MatMulNBits",
        ["A", *(n for n, _ in arrays)],
        ["Y"],
        domain="com.microsoft",
        K=K,
        N=24,
        bits=bits,
        block_size=32,
    )
    inits = [numpy_helper.from_array(a, n) for n, a in arrays]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", 1, [None, K])],
        [helper.make_tensor_value_info("Y", 1, None)],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a = rng.standard_normal((3, K)).astype(np.float32)
    assert np.abs(sess.run(None, {"A": a})[0] - a @ deq).max() < 1e-4


def quantize_cli(*args):
    return CliRunner().invoke(main, ["quantize", *map(str, args)])


def assert_refused(result, phrase, out):
    assert result.exit_code != 0, result.output
    assert phrase in result.output, result.output
    assert not out.exists()


def test_bad_requests_write_nothing(tiny_export, variants, tmp_path):
    out = tmp_path / "out"
    assert_refused(quantize_cli(tiny_export, "-o", out, "--mode", "int3"), "Unknown mode 'int3'", out)
    (tmp_path / "plain").mkdir()
    assert_refused(quantize_cli(tmp_path / "plain", "-o", out, "--mode", "int8"), "not a gpt2edge export", out)
    r = quantize_cli(tiny_export, "-o", tiny_export, "--mode", "int8", "--force")
    assert r.exit_code == 1 and "output folder is the input folder" in r.output
    assert_refused(quantize_cli(variants["int8"], "-o", out, "--mode", "int8"), "already int8", out)
    assert_refused(quantize_cli(variants["int8"], "-o", out, "--mode", "fp16"), "would not shrink it", out)
    assert_refused(quantize_cli(variants["fp16"], "-o", out, "--mode", "fp16"), "already fp16", out)
    assert_refused(quantize_cli(tiny_export, "-o", out, "--mode", "int4", "--block-size", "24"), "power of two", out)
    assert_refused(quantize_cli(tiny_export, "-o", out, "--mode", "fp16", "--head-bits", "4"), "int8/int4", out)
    assert_refused(quantize_cli(tiny_export, "-o", out, "--mode", "fp16", "--symmetric"), "int8/int4", out)
    with pytest.raises(QuantizeError, match="--head-bits 4 is for int4"):
        make_recipe("int8", head_bits=4)


def test_parity_cli_thresholds(tiny_export, variants, tiny_checkpoint):
    ok = CliRunner().invoke(main, ["parity", str(tiny_export), str(variants["int8"]), "--max-kl", "1e-2", "--json"])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(main, ["parity", str(tiny_export), str(variants["int4"]), "--min-top1", "0.999"])
    assert bad.exit_code == 1 and "Parity thresholds exceeded: top1_agreement" in bad.output
    src = CliRunner().invoke(
        main, ["parity", str(tiny_export), "-m", str(tiny_checkpoint), "--max-kl", "1e-6", "--min-greedy-match", "64"]
    )
    assert src.exit_code == 0, src.output


def test_weight_shared_by_two_matmuls_is_packed_once():
    """The exporter may deduplicate identical initializers; both readers must use one packed copy."""
    from gpt2edge.quantize.weight_only import quantize_weights

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", 1, [None, 64])],
        [helper.make_tensor_value_info("y", 1, None)],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    q = quantize_weights(model, 8, 32, None, 0, accuracy_level=0)
    names = [i.name for i in q.graph.initializer]
    assert len(names) == len(set(names)) and "W.q8" in names
    sess = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    ref = x @ w @ w
    assert np.abs(sess.run(None, {"x": x})[0] - ref).max() < 0.02 * np.abs(ref).max()  # 8-bit, two matmuls
