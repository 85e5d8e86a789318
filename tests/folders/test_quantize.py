"""Quantized variants: they run, meet stated quality thresholds against fp32, shrink the file, and refuse
bad requests. Thresholds (also in docs/parity.md) are for the tiny seeded test model, measured with ~3x margin:

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
from gpt2edge.manifest import digest_folder, load_manifest
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
    manifest = dict(load_manifest(folder).raw)
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
    assert load_manifest(variants["fp16"]).raw["graph"]["kv_dtype"] == "float16"
    g.generate("The river", max_new_tokens=6, ignore_eos=True)
    assert g.lm.cache.allocations == 1


def test_manifest_records_recipe_parent_and_sizes(variants, tiny_export):
    parent = dict(load_manifest(tiny_export).raw)
    m = dict(load_manifest(variants["int4"]).raw)
    q = m["quantization"]
    # the default block 256 fits the tiny model's 64-wide rows as 64 (test_default_block_divides_every_row)
    assert q["recipe"]["mode"] == "int4" and q["recipe"]["block_size"] == 64 and q["recipe"]["head_bits"] == 8
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
    fp32 = load_manifest(variants["int8"]).raw["quantization"]["parent"]["path"]
    good = compare_folders(fp32, variants["int8"])
    bad = compare_folders(fp32, corrupted)
    assert bad["mean_kl"] > 10 * good["mean_kl"]
    assert good["mean_kl"] == pytest.approx(load_manifest(variants["int8"]).raw["quality"]["mean_kl"], rel=1e-6)


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
    ratio = load_manifest(tmp_path / mode).raw["quantization"]["ratio"]
    assert ratio <= limit, f"{mode} file is {ratio:.1%} of fp32"


def test_tied_table_stored_once_and_keep_head_fp32(variants, tiny_export, tmp_path):
    vocab = load_manifest(tiny_export).raw["dims"]["vocab_size"]
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


def _matmulnbits(folder) -> dict[str, dict]:
    """MatMulNBits node name -> its attributes and whether it reads zero points."""
    nodes = [n for n in onnx.load(str(folder / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    return {
        n.name: {**{a.name: helper.get_attribute_value(a) for a in n.attribute}, "zp": len(n.input) > 3 and n.input[3]}
        for n in nodes
    }


def test_int4_default_recipe_is_the_measured_one(variants):
    """int4's default is block 256 with zero points, the 8-bit head at block 256, int8 activations: the recipe
    that decodes ahead of llama.cpp Q4_0 and prefills no slower than int8 on AVX-512 VNNI (benchmarks/README)."""
    r = make_recipe("int4")
    assert (r.block_size, r.symmetric, r.accuracy_level, r.head_bits, r.head_block_size) == (256, False, 4, 8, 256)
    assert make_recipe("int8").head_block_size == 128  # int8 keeps its own head block
    nodes = _matmulnbits(variants["int4"])
    head = [a for a in nodes.values() if a["bits"] == 8]
    layers = [a for a in nodes.values() if a["bits"] == 4]
    assert len(head) == 1 and layers and all(a["zp"] for a in nodes.values())
    # the tiny model's width (64) caps the head's block (it must divide a row for the embedding lookup) and the
    # default layer block (so that no row is padded to a whole block of 256)
    assert head[0]["block_size"] == 64 and {a["block_size"] for a in layers} == {64}
    assert all(a["accuracy_level"] == 4 for a in nodes.values())


@pytest.mark.parametrize(
    "mode, n_embd, n_inner, asked, block",
    [
        ("int4", 768, 3072, None, 256),  # GPT-2 small / distilgpt2: the measured default, unpadded
        ("int4", 1280, 5120, None, 256),  # gpt2-large
        ("int4", 1600, 6400, None, 64),  # gpt2-xl: 256 would pad K = 1600 to 1792
        ("int4", 160, 640, None, 32),  # trained-gpt2-py
        ("int8", 1600, 6400, None, 64),  # int8's 128 would pad too
        ("int4", 96, 333, None, 256),  # an odd n_inner: no block divides it, the default stays (padded)
        ("int4", 1600, 6400, 256, 256),  # asked for: kept, rows padded
        ("int8", 768, 3072, 32, 32),
    ],
)
def test_default_block_divides_every_row(mode, n_embd, n_inner, asked, block):
    """A default block shrinks to the largest power of two dividing every matrix's rows; an asked one stays."""
    r = make_recipe(mode, block_size=asked).fitted(n_embd, n_inner)
    assert r.block_size == block
    assert r.to_json()["block_size"] == block and "block_defaulted" not in r.to_json()


def test_symmetric_switch_drops_zero_points(variants, tiny_export, tmp_path):
    """Both modes store zero points by default; --symmetric drops them everywhere (llama.cpp Q4_0's form)."""
    assert "h.0.mlp.c_fc.weight.zero_points" in _zero_point_tables(variants["int4"])
    assert "h.0.mlp.c_fc.weight.zero_points" in _zero_point_tables(variants["int8"])
    out = tmp_path / "int4-sym"
    r = quantize_cli(tiny_export, "-o", out, "--mode", "int4", "--symmetric", "--no-report")
    assert r.exit_code == 0, r.output
    assert load_manifest(out).raw["quantization"]["recipe"]["symmetric"] is True
    assert _zero_point_tables(out) == []
    # the symmetric form's quality, through the same report as the default's
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
    assert load_manifest(out).raw["quantization"]["recipe"]["head_bits"] == 4
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
    assert_refused(quantize_cli(tiny_export, "-o", out, "--mode", "int3"), "'int3' is not one of", out)
    (tmp_path / "plain").mkdir()
    assert_refused(quantize_cli(tmp_path / "plain", "-o", out, "--mode", "int8"), "not a gpt2edge export", out)
    r = quantize_cli(tiny_export, "-o", tiny_export, "--mode", "int8", "--force")
    assert r.exit_code == 1 and "output folder is the input folder" in r.output
    assert_refused(quantize_cli(variants["int8"], "-o", out, "--mode", "int8"), "already int8", out)
    assert_refused(quantize_cli(variants["int8"], "-o", out, "--mode", "fp16"), "would not shrink it", out)
    assert_refused(quantize_cli(variants["fp16"], "-o", out, "--mode", "fp16"), "already fp16", out)
    assert_refused(quantize_cli(tiny_export, "-o", out, "--mode", "int4", "--block-size", "24"), "'24' is not one", out)
    assert_refused(quantize_cli(tiny_export, "-o", out, "--mode", "fp16", "--head-bits", "4"), "int8/int4", out)
    assert_refused(quantize_cli(tiny_export, "-o", out, "--mode", "fp16", "--symmetric"), "int8/int4", out)
    with pytest.raises(QuantizeError, match="--head-bits 4 is for int4"):
        make_recipe("int8", head_bits=4)
    with pytest.raises(QuantizeError, match="Unknown mode 'int3'"):
        make_recipe("int3")


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


@pytest.mark.parametrize("block", ["0", "8", "512", "1024"])
def test_block_sizes_matmulnbits_cannot_run_are_refused(tiny_export, tmp_path, block):
    """ONNX Runtime packs and runs block sizes 16..256 (powers of two); 512 and up abort in its C++ code,
    and 0 used to fall back to the default silently."""
    out = tmp_path / "out"
    r = quantize_cli(tiny_export, "-o", out, "--mode", "int4", "--block-size", block)
    assert r.exit_code == 2 and f"Invalid value for '--block-size': '{block}' is not one of" in r.output, r.output
    assert not out.exists()
    with pytest.raises(QuantizeError, match="power of two from 16 to 256"):
        make_recipe("int4", block_size=int(block))


def test_every_supported_block_size_packs_and_runs():
    from gpt2edge.quantize.primitives import BLOCK_SIZES

    w = np.random.default_rng(0).standard_normal((512, 8)).astype(np.float32)
    for block in BLOCK_SIZES:
        assert make_recipe("int8", block_size=block).block_size == block
        q = quantize_blockwise(w, 4, block)
        assert np.abs(dequantize_blockwise(q) - w).max() < np.abs(q.scales).max()


def test_choices_are_click_choices_shown_in_help():
    runner = CliRunner()
    help_text = " ".join(runner.invoke(main, ["quantize", "--help"]).output.split())
    for shown in ("[fp16|int8|int4]", "[16|32|64|128|256]", "[0|1|2|3|4]", "[4|8]"):
        assert shown in help_text
    assert "18<=x<=23" in runner.invoke(main, ["export", "--help"]).output
    for args, option in [
        (["--mode", "int8", "--head-bits", "5"], "--head-bits"),
        (["--mode", "int8", "--accuracy-level", "7"], "--accuracy-level"),
        (["--mode", "int2"], "--mode"),
    ]:
        r = runner.invoke(main, ["quantize", "no-such-folder", "-o", "x", *args])
        assert r.exit_code == 2 and f"Invalid value for '{option}'" in r.output, r.output  # before any work
    r = runner.invoke(main, ["export", "-m", "no-such-folder", "x", "--opset", "17"])
    assert r.exit_code == 2 and "Invalid value for '--opset'" in r.output


def _one_token_text(folder) -> str:
    from gpt2edge.runtime.model.tokenizer import TextTokenizer

    tok = TextTokenizer(folder / "tokenizer.json")
    text = tok.decode([tok.encode("The river")[0]])
    assert len(tok.encode(text)) == 1
    return text


@pytest.mark.parametrize("one_token", [False, True], ids=["empty", "one-token"])
def test_report_text_needs_two_tokens(tiny_export, variants, tmp_path, one_token):
    text = tmp_path / "text.txt"
    text.write_text(_one_token_text(tiny_export) if one_token else "")
    n = int(one_token)
    out = tmp_path / "out"
    r = quantize_cli(tiny_export, "-o", out, "--mode", "int8", "--text", text)
    assert r.exit_code == 1 and r.output.strip() == f"error: The --text has {n} token(s); the quality report " + (
        "needs at least 2 (it scores each next token). Pass a longer text, or leave --text out for the built-in one."
    ), r.output
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    r = CliRunner().invoke(main, ["parity", str(tiny_export), str(variants["int8"]), "--text", str(text)])
    assert r.exit_code == 1 and r.output.startswith(f"error: The --text has {n} token(s)"), r.output


@pytest.mark.parametrize("key, value", [("vocab_size", 512), ("n_positions", 64)])
def test_parity_refuses_folders_of_another_model_before_any_work(tiny_export, tmp_path, monkeypatch, key, value):
    import json

    from gpt2edge import quality

    other = tmp_path / "other"
    shutil.copytree(tiny_export, other)
    manifest = json.loads((other / "manifest.json").read_text())
    before = manifest["dims"][key]
    manifest["dims"][key] = value
    (other / "manifest.json").write_text(json.dumps(manifest))

    def no_session(*a, **k):
        raise AssertionError("a session was built before the manifests were compared")

    monkeypatch.setattr(quality, "load_graph", no_session)
    for a, b in [(tiny_export, other), (other, tiny_export)]:
        r = CliRunner().invoke(main, ["parity", str(a), str(b)])
        assert r.exit_code == 1, r.output
        assert r.output.startswith(f"error: {a} and {b} are not variants of one model: {key} "), r.output
    assert f"{key} {before} vs {value}" in CliRunner().invoke(main, ["parity", str(tiny_export), str(other)]).output


def test_quality_report_names_the_final_folder(variants):
    for folder in variants.values():
        q = load_manifest(folder).raw["quality"]
        assert q["variant"] == str(folder), q["variant"]  # not the temporary .out.tmp-… it was measured in


def test_kl_is_never_negative_and_zero_for_equal_distributions():
    """A float32 log_softmax sums to 1 only to ~1e-7: the old float32-normalised formula reported KL
    -1e-6 for identical distributions. Renormalised in float64, each KL term is >= 0."""
    from gpt2edge.quality import compare, kl_divergence

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 400)).astype(np.float32) * 4
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))  # float32, as the graph returns them
    tokens = list(rng.integers(0, 400, 64))
    for var in (lp + np.float32(1e-6), lp - np.float32(3e-7), lp + rng.normal(0, 1e-7, lp.shape).astype(np.float32)):
        report = compare(lp, var, tokens, [[1, 2]], [[1, 2]], [16])
        assert 0.0 <= report["mean_kl"] < 1e-11 and report["max_kl"] >= 0.0, report["mean_kl"]
    assert np.all(kl_divergence(lp, lp) == 0.0)
    # and where the distributions differ, it is the textbook value (float64, from normalised probabilities)
    other = lp + rng.normal(0, 0.5, lp.shape).astype(np.float32)
    p = np.exp(lp.astype(np.float64))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(other.astype(np.float64))
    q /= q.sum(-1, keepdims=True)
    np.testing.assert_allclose(kl_divergence(lp, other), (p * np.log(p / q)).sum(-1), rtol=1e-9)


def test_greedy_match_is_checked_from_several_points_of_the_text(tiny_export, tmp_path):
    """A variant that differs only late in the context (its position rows from 100 on are noise): greedy
    decoding from the first 16 tokens never gets there (64/64 reported), the later starts do."""
    from gpt2edge.quality import GREEDY_STARTS

    late = tmp_path / "late"
    shutil.copytree(tiny_export, late)
    model = onnx.load(str(late / "model.onnx"))
    wpe = next(i for i in model.graph.initializer if i.name == "wpe.weight")
    rows = numpy_helper.to_array(wpe).copy()
    rows[100:] = np.random.default_rng(0).standard_normal(rows[100:].shape) * 3
    wpe.CopyFrom(numpy_helper.from_array(rows, wpe.name))
    onnx.save(model, str(late / "model.onnx"))

    report = compare_folders(tiny_export, late)
    starts = [g["start"] for g in report["greedy_matches"]]
    assert len(starts) == GREEDY_STARTS and starts[0] == 16 and starts[-1] + 64 <= 128
    first = report["greedy_matches"][0]
    assert first["match"] == 64  # what the report used to say
    assert report["greedy_match"] < 64 and report["greedy_match_start"] > 16
    assert report["greedy_match"] == min(g["match"] for g in report["greedy_matches"])
    # the figure is the real first divergence of the two folders' greedy tokens from that start
    from gpt2edge.runtime.decoding.generate import generate
    from gpt2edge.runtime.decoding.sampling import SamplingParams
    from gpt2edge.sample_text import SAMPLE_TEXT

    params = SamplingParams(max_new_tokens=64, do_sample=False)
    a, b = Generator(tiny_export), Generator(late, verify=False)
    prompt = a.tokenizer.encode(SAMPLE_TEXT)[: report["greedy_match_start"]]
    ga, gb = (generate(g.lm, g.tokenizer, [prompt], params, pad_id=0).generated[0] for g in (a, b))
    assert next(i for i, (x, y) in enumerate(zip(ga, gb)) if x != y) == report["greedy_match"]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("head_bits", [8, 4])
def test_embedding_rows_equal_the_packed_table_exactly(head_bits, symmetric):
    """The token and position lookups read the packed tables with one GatherBlockQuantized (4-bit tables
    with zero points: dequantized by hand, see weight_only.py); the rows equal the NumPy dequantization."""
    from gpt2edge.quantize.weight_only import embedding_block_size, quantize_weights

    V, P, C = 50, 16, 64
    rng = np.random.default_rng(head_bits)
    wte, wpe = (rng.standard_normal((n, C)).astype(np.float32) for n in (V, P))
    nodes = [
        helper.make_node("Gather", ["wte", "ids"], ["tok"], axis=0),
        helper.make_node("Gather", ["wpe", "pos"], ["pos_rows"], axis=0),
        helper.make_node("Gemm", ["x", "wte"], ["logits"], transB=1),
    ]
    ints = [helper.make_tensor_value_info(n, onnx.TensorProto.INT64, [None, None]) for n in ("ids", "pos")]
    graph = helper.make_graph(
        nodes,
        "g",
        [*ints, helper.make_tensor_value_info("x", 1, [None, C])],
        [helper.make_tensor_value_info(n, 1, None) for n in ("tok", "pos_rows", "logits")],
        [numpy_helper.from_array(wte, "wte"), numpy_helper.from_array(wpe, "wpe")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    head_block = 128 if head_bits == 8 else 32
    q = quantize_weights(model, 4, 32, head_bits, head_block, accuracy_level=0, symmetric=symmetric)
    ops = [n.op_type for n in q.graph.node]
    by_hand = head_bits == 4 and not symmetric  # ONNX Runtime < 1.27 misreads these zero points
    assert ops.count("GatherBlockQuantized") == (1 if by_hand else 2), ops
    assert ("BitShift" in ops) == by_hand

    sess = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = rng.integers(0, V, (2, 5))
    pos = np.arange(10).reshape(2, 5)
    x = rng.standard_normal((2, C)).astype(np.float32)
    tok, pos_rows, logits = sess.run(None, {"ids": ids, "pos": pos, "x": x})
    table = dequantize_blockwise(quantize_blockwise(wte.T, head_bits, embedding_block_size(C, head_block), symmetric))
    positions = dequantize_blockwise(quantize_blockwise(wpe.T, 8, embedding_block_size(C, 128), symmetric))
    assert np.abs(tok - table.T[ids]).max() == 0.0
    assert np.abs(pos_rows - positions.T[pos]).max() == 0.0
    assert np.abs(logits - x @ table).max() < 1e-4  # the head's MatMulNBits reads the same packed table


def test_quantized_export_looks_up_embeddings_with_gather_block_quantized(variants):
    for mode in ("int8", "int4"):
        ops = [n.op_type for n in onnx.load(str(variants[mode] / "model.onnx")).graph.node]
        assert ops.count("GatherBlockQuantized") == 2 and "BitShift" not in ops, (mode, ops)


def test_reports_on_stdout_and_json_stdout_is_pure(tiny_export, variants, tmp_path):
    """quantize and parity print their report the same way: on stdout, or on stderr under --json (whose
    stdout is one JSON document); no progress bar off a terminal."""
    import json

    r = quantize_cli(tiny_export, "-o", tmp_path / "a", "--mode", "int8")
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert r.stdout.startswith("int8 vs fp32:\n") and "mean KL(ref || variant)" in r.stdout
    r = quantize_cli(tiny_export, "-o", tmp_path / "b", "--mode", "int8", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["quality"]["variant"] == str(tmp_path / "b")
    assert r.stderr.startswith("int8 vs fp32:\n"), r.stderr

    pair = [str(tiny_export), str(variants["int8"])]
    r = CliRunner().invoke(main, ["parity", *pair])
    assert r.exit_code == 0 and r.stderr == "" and "mean KL(ref || variant)" in r.stdout, r.output
    r = CliRunner().invoke(main, ["parity", *pair, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["violations"] == []
    assert "mean KL(ref || variant)" in r.stderr


@pytest.mark.parametrize(
    "mode, n_embd, n_inner, block, op",
    [
        ("int4", 1600, 6400, 256, "MatMulNBits"),  # gpt2-xl: 256 pads K = 1600 to 1792 (12 %), measured faster than 64
        ("int8", 1600, 6400, 128, "DynamicQuantizeMatMul"),  # per-column int8: no block to pad
        ("int4", 160, 640, 32, "MatMulNBits"),  # trained-gpt2-py: 256 would pad 160 by 60 %, so the block shrinks
        ("int8", 160, 640, 32, "MatMulNBits"),
        ("int4", 768, 3072, 256, "MatMulNBits"),  # GPT-2 small: divides, nothing changes
        ("int8", 768, 3072, 128, "MatMulNBits"),
    ],
)
def test_avx512_target_pads_unaligned_rows(mode, n_embd, n_inner, block, op):
    """The avx512-vnni target pads rows its default block does not divide (at most 12.5 % more bytes) instead of
    shrinking the block, and int8 layers switch to the per-column op there; the built-in defaults still shrink."""
    r = make_recipe(mode, target="avx512-vnni").fitted(n_embd, n_inner)
    assert (r.block_size, r.int8_op) == (block, op)
    plain = make_recipe(mode).fitted(n_embd, n_inner)
    assert plain.int8_op == "MatMulNBits" and plain.block_size <= block
