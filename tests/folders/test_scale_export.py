"""The path big models take, at a size CI affords: external data (the 2 GB threshold lowered), streamed
rewrites, one copy of the weights during export, and the memory/disk estimate checked before any work."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.errors import ResourceError
from gpt2edge.quantize import make_recipe, quantize_model


@pytest.fixture(scope="module")
def external_export(tiny_checkpoint, tmp_path_factory):
    """The tiny model exported as if it were over 2 GB: weights in model.onnx.data."""
    from gpt2edge.export import export_model, onnx_graph

    mp = pytest.MonkeyPatch()
    mp.setattr(onnx_graph, "EXTERNAL_DATA_THRESHOLD", 0)
    try:
        out = tmp_path_factory.mktemp("ext") / "fp32"
        export_model(str(tiny_checkpoint), out, kv_cache="shared", log=None)
    finally:
        mp.undo()
    return out


def greedy(folder, n=8):
    import json

    res = CliRunner().invoke(main, ["generate", str(folder), "-p", "Hello there", "--max-new-tokens", str(n), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    return out.get("token_ids") or out.get("tokens") or out.get("text") or out


def test_external_export_validates_loads_and_generates_like_one_file(external_export, tiny_export_shared):
    m = onnx.load(str(external_export / "model.onnx"), load_external_data=False)
    big = [i for i in m.graph.initializer if np.prod(i.dims) > 4096]
    assert big and all(i.data_location == onnx.TensorProto.EXTERNAL for i in big)
    # every byte of those weights is in the data file, and what the graph file keeps inline is a tenth of that at
    # most (the graph file's own size is not the measure: torch records stack traces with the checkout's path)
    itemsize = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.data_type).itemsize for i in big}
    weight_bytes = sum(int(np.prod(i.dims)) * itemsize[i.name] for i in big)
    assert (external_export / "model.onnx.data").stat().st_size >= weight_bytes
    assert 10 * sum(i.ByteSize() for i in m.graph.initializer) < weight_bytes
    assert greedy(external_export) == greedy(tiny_export_shared)  # same weights, same greedy tokens


def test_one_file_export_is_streamed_from_external_data(tiny_export_shared):
    """Under the threshold the export writes external data first, then one self-contained file."""
    assert not list(tiny_export_shared.glob("*.data"))
    m = onnx.load(str(tiny_export_shared / "model.onnx"))
    onnx.checker.check_model(m)
    assert all(i.data_location == onnx.TensorProto.DEFAULT for i in m.graph.initializer)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("variant_external", [False, True])
def test_quantize_streams_from_external_parent(external_export, tmp_path, monkeypatch, mode, variant_external):
    from gpt2edge.quantize import graph as quantize_graph

    if variant_external:
        monkeypatch.setattr(quantize_graph, "EXTERNAL_DATA_THRESHOLD", 0)
    out = tmp_path / mode
    manifest = quantize_model(external_export, out, make_recipe(mode), log=None)
    assert (out / "model.onnx.data").exists() == variant_external
    assert manifest["graph"]["files"] == (["model.onnx", "model.onnx.data"] if variant_external else ["model.onnx"])
    limit = {"int8": 5e-3, "int4": 0.3}[mode]  # test_quantize's thresholds
    assert manifest["quality"]["mean_kl"] <= limit, manifest["quality"]
    greedy(out)


@pytest.fixture(scope="module")
def external_concat(tiny_export, tmp_path_factory):
    """tiny_export (a --kv-cache concat export, what fp16 is made from) rewritten with its weights in
    model.onnx.data, the manifest's files and checksums renewed: an fp32 parent as gpt2-large/xl's are (the
    LayerNorm vectors outside too, as a 1600-wide model's are)."""
    import json
    import shutil

    from gpt2edge.manifest import write_manifest
    from gpt2edge.onnx_io import stream

    out = tmp_path_factory.mktemp("extc") / "fp32"
    shutil.copytree(tiny_export, out)
    model = stream.load_graph(tiny_export / "model.onnx")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "INLINE_BELOW", 64)  # the LayerNorm vectors outside too (shape constants stay inline)
        files = stream.save_streaming(model, out / "model.onnx", stream.passthrough(tiny_export), external=True)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["graph"]["files"] = files
    write_manifest(out, {k: v for k, v in manifest.items() if k != "files"})
    return out


@pytest.mark.parametrize("variant_external", [False, True])
def test_fp16_streams_from_external_parent(external_concat, tiny_export, tmp_path, monkeypatch, variant_external):
    """fp16 of an external-data parent: each weight is rounded as it is written (never the model in memory),
    to exactly the tensors ONNX Runtime's converter makes from the fully loaded graph, within fp16's thresholds."""
    from onnx import numpy_helper

    from gpt2edge.quantize import graph as quantize_graph
    from gpt2edge.quantize import half

    ref = tmp_path / "ref"  # the one-file parent, loaded whole: the converter rounds every weight itself
    quantize_model(tiny_export, ref, make_recipe("fp16"), report=False, log=None)
    rounded = []
    real = half.round_fp16
    monkeypatch.setattr(half, "round_fp16", lambda w: rounded.append(w.size) or real(w))
    monkeypatch.setattr(half, "CHUNK", 1000)  # several chunks per matrix
    if variant_external:
        monkeypatch.setattr(quantize_graph, "EXTERNAL_DATA_THRESHOLD", 0)
    out = tmp_path / "fp16"
    manifest = quantize_model(external_concat, out, make_recipe("fp16"), log=None)
    assert manifest["graph"]["files"] == (["model.onnx", "model.onnx.data"] if variant_external else ["model.onnx"])
    assert manifest["graph"]["precision"] == "fp16" and manifest["graph"]["kv_dtype"] == "float16"

    def tensors(folder):
        return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(folder / "model.onnx")).graph.initializer}

    got, want = tensors(out), tensors(ref)
    a, b = (onnx.load(str(f / "model.onnx"), load_external_data=False).graph for f in (out, ref))
    assert a.node == b.node and a.value_info == b.value_info and a.output == b.output
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == w.dtype and np.array_equal(got[name], w), name
    n_half = sum(w.dtype == np.float16 and w.nbytes >= 2048 for w in want.values())
    assert n_half and len(rounded) >= n_half  # the big fp16 tensors were rounded on the way out
    q = manifest["quality"]  # test_quantize's fp16 thresholds
    assert q["mean_kl"] <= 1e-4 and q["top1_agreement"] >= 0.99 and q["max_abs_logprob_diff"] <= 5e-2, q
    assert greedy(out) == greedy(ref)


def test_truncated_or_missing_external_data_is_refused(external_export, tmp_path):
    import shutil

    for damage in ("truncate", "remove", "flip"):
        bad = tmp_path / damage
        shutil.copytree(external_export, bad)
        data = bad / "model.onnx.data"
        if damage == "truncate":
            with open(data, "r+b") as f:
                f.truncate(data.stat().st_size // 2)
        elif damage == "flip":  # same size, one weight's byte changed: only the checksum can tell
            with open(data, "r+b") as f:
                f.seek(data.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x40]))
        else:
            data.unlink()
        res = CliRunner().invoke(main, ["generate", str(bad), "-p", "Hi", "--max-new-tokens", "2"])
        assert res.exit_code != 0 and "model.onnx.data" in res.output, res.output
        assert res.output.startswith("error:") or "\nerror:" in res.output, res.output
        if damage == "flip":
            assert "checksum" in res.output or "sha256" in res.output, res.output
        out = tmp_path / f"q-{damage}"
        res = CliRunner().invoke(main, ["quantize", str(bad), "-o", str(out), "--mode", "int4", "--no-report"])
        assert res.exit_code != 0 and not out.exists(), res.output


def test_stream_reader_refuses_truncated_data(external_export, tmp_path):
    import shutil

    from gpt2edge.onnx_io.stream import load_graph, tensor_array

    bad = tmp_path / "t"
    shutil.copytree(external_export, bad)
    with open(bad / "model.onnx.data", "r+b") as f:
        f.truncate(100)
    model = load_graph(bad / "model.onnx")
    big = max(model.graph.initializer, key=lambda i: int(np.prod(i.dims)))
    with pytest.raises(OSError, match="truncated"):
        tensor_array(big, bad)


@pytest.mark.parametrize("external", [False, True])
def test_streaming_writer_round_trips(tmp_path, external):
    from onnx import helper, numpy_helper

    from gpt2edge.onnx_io.stream import load_graph, passthrough, save_streaming, tensor_array

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    b = rng.integers(0, 9, (48,)).astype(np.int64)
    shape = helper.make_tensor("shape", onnx.TensorProto.INT64, [2], [1, 48])  # typed field, not raw_data
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", 1, [1, 64])],
        [helper.make_tensor_value_info("y", 1, [1, 48])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B"), shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    files = save_streaming(model, tmp_path / "m.onnx", passthrough(tmp_path), external=external)
    assert files == (["m.onnx", "m.onnx.data"] if external else ["m.onnx"])
    back = onnx.load(str(tmp_path / "m.onnx"))
    onnx.checker.check_model(back)
    got = {i.name: numpy_helper.to_array(i) for i in back.graph.initializer}
    assert np.array_equal(got["W"], w) and np.array_equal(got["B"], b) and list(got["shape"]) == [1, 48]
    lazy = load_graph(tmp_path / "m.onnx")
    assert np.array_equal(tensor_array(next(i for i in lazy.graph.initializer if i.name == "W"), tmp_path), w)


def test_export_shares_the_checkpoints_weights(hf_model):
    """One copy of the weights during export: the exportable model's parameters are the checkpoint's tensors."""
    from gpt2edge.export.model import from_hf_model

    model = from_hf_model(hf_model)
    assert model.wte.weight.data_ptr() == hf_model.transformer.wte.weight.data_ptr()
    assert model.h[0].attn.c_attn.weight.data_ptr() == hf_model.transformer.h[0].attn.c_attn.weight.data_ptr()
    assert not any(p.is_meta for p in model.parameters())


def test_too_little_memory_is_refused_before_work(tiny_checkpoint, tiny_export, tmp_path, monkeypatch):
    from gpt2edge.budget import needs

    monkeypatch.setattr(needs, "available_memory", lambda: 1)
    out = tmp_path / "e"
    res = CliRunner().invoke(main, ["export", "-m", str(tiny_checkpoint), str(out)])
    assert res.exit_code == 1 and not out.exists()
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error:") and "GB of memory" in line and "--no-validate" in line, res.output
    res = CliRunner().invoke(main, ["quantize", str(tiny_export), "-o", str(out), "--mode", "int4"])
    assert res.exit_code == 1 and not out.exists() and "--no-report" in res.output, res.output
    with pytest.raises(ResourceError):
        from gpt2edge.export import make_random_checkpoint

        make_random_checkpoint(out, size="xl")
    assert not out.exists()


def test_too_little_disk_is_refused_before_work(tiny_checkpoint, tmp_path, monkeypatch):
    from gpt2edge.budget import needs

    monkeypatch.setattr(needs, "free_disk", lambda path: 1000)
    out = tmp_path / "e"
    res = CliRunner().invoke(main, ["export", "-m", str(tiny_checkpoint), str(out)])
    assert res.exit_code == 1 and not out.exists() and "free on the disk" in res.output, res.output


@pytest.mark.parametrize("short", ["memory", "disk"])
@pytest.mark.parametrize("command", ["export", "random-checkpoint", "int4", "int8", "fp16"])
def test_every_writer_refuses_a_short_machine_before_work(tiny_checkpoint, tiny_export, tmp_path, monkeypatch,
                                                          short, command):  # fmt: skip
    """export, random-checkpoint and quantize (each mode) check memory and disk first: one line naming the
    shortage, nothing written, not even a temporary folder."""
    from gpt2edge.budget import needs

    if short == "memory":
        monkeypatch.setattr(needs, "available_memory", lambda: 1)
    else:
        monkeypatch.setattr(needs, "free_disk", lambda path: 1000)
    out = tmp_path / "out"
    args = {
        "export": ["export", "-m", str(tiny_checkpoint), str(out)],
        "random-checkpoint": ["random-checkpoint", str(out), "--size", "small"],
    }.get(command, ["quantize", str(tiny_export), "-o", str(out), "--mode", command])
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and list(tmp_path.iterdir()) == [], res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error:") and ("GB of memory" if short == "memory" else "free on the disk") in line, line


def test_estimates_grow_linearly_and_match_the_shapes():
    from gpt2edge.budget.needs import export_need, n_parameters, quantize_need
    from gpt2edge.export.random_checkpoint import SIZES

    params = {k: n_parameters(SIZES[k]) for k in ("small", "medium", "large", "xl")}
    assert [round(p / 1e6) for p in params.values()] == [124, 355, 774, 1558]  # the published GPT-2 sizes
    xl = 4 * params["xl"]
    need = export_need(xl, True, 1_900_000_000)
    assert need.memory <= 2.5 * xl and need.lighter is not None
    for mode in ("fp16", "int8", "int4"):  # streamed, every mode
        assert quantize_need(xl, mode, report=False).memory <= 1.5 * xl, mode
        assert quantize_need(xl, mode, report=True).memory <= 1.5 * xl, mode  # its sessions are lean


def test_ort_format_of_a_graph_over_2gb_is_refused(tiny_export, tmp_path, monkeypatch):
    from gpt2edge.convert import ort_format

    monkeypatch.setattr(ort_format, "MAX_ORT_BYTES", 1000)  # the tiny graph stands for one over 2 GB
    out = tmp_path / "ort"
    res = CliRunner().invoke(main, ["convert", str(tiny_export), "-o", str(out), "--format", "ort"])
    assert res.exit_code == 1 and not out.exists()
    assert "Quantize it first" in res.output and "2 GB" in res.output, res.output


def test_ort_format_counts_the_external_data(external_export, tmp_path, monkeypatch):
    """The size that refuses ORT format is the graph's weights, not its small model.onnx beside model.onnx.data."""
    from gpt2edge.convert import ort_format

    graph_file = (external_export / "model.onnx").stat().st_size
    assert graph_file < (external_export / "model.onnx.data").stat().st_size
    monkeypatch.setattr(ort_format, "MAX_ORT_BYTES", graph_file + 1)  # the .onnx alone would pass
    out = tmp_path / "ort"
    res = CliRunner().invoke(main, ["convert", str(external_export), "-o", str(out), "--format", "ort"])
    assert res.exit_code == 1 and not out.exists() and "Quantize it first" in res.output, res.output


def test_self_contained_graph_is_scanned_not_loaded(tiny_export, tmp_path, monkeypatch):
    """A one-file parent is read field by field: its weights stay in the file until each is quantized, and the
    variant equals the one made from a fully loaded graph."""
    from onnx import numpy_helper

    from gpt2edge.onnx_io import stream as onnx_stream

    path = tiny_export / "model.onnx"
    monkeypatch.setattr(onnx_stream, "SCAN_ABOVE", 0)
    scanned = onnx_stream.load_graph(path)
    loaded = onnx.load(str(path))
    assert scanned.graph.node == loaded.graph.node and scanned.opset_import == loaded.opset_import
    assert [i.name for i in scanned.graph.initializer] == [i.name for i in loaded.graph.initializer]
    for a, b in zip(scanned.graph.initializer, loaded.graph.initializer):
        assert np.array_equal(onnx_stream.tensor_array(a, tiny_export), numpy_helper.to_array(b)), a.name
    quantize_model(tiny_export, tmp_path / "scan", make_recipe("int4"), report=False, log=None)
    # the manifest's decode bytes come from the scanned graph too (never the weights loaded), and agree
    from gpt2edge.onnx_io.stats import decode_weight_bytes

    with monkeypatch.context() as mp:
        mp.setattr(onnx, "load", None)  # a 1.5 GB graph loaded whole here held it twice (fp16 of gpt2-large)
        scanned_bytes = decode_weight_bytes(path)
    monkeypatch.setattr(onnx_stream, "SCAN_ABOVE", 1 << 62)
    assert decode_weight_bytes(path) == scanned_bytes > 0
    quantize_model(tiny_export, tmp_path / "load", make_recipe("int4"), report=False, log=None)
    assert (tmp_path / "scan" / "model.onnx").read_bytes() == (tmp_path / "load" / "model.onnx").read_bytes()
