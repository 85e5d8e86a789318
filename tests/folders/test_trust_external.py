"""Every file a graph loads is a listed, checksummed file: a graph whose initializers point their external data
at anything but the manifest's graph files is refused before ONNX Runtime opens it (with and without
verification, in the runtime and in convert); `convert --format genai` reads the head from the graph itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from gpt2edge.cli import main
from gpt2edge.convert import convert_folder
from gpt2edge.errors import ConvertError, ModelFolderError
from gpt2edge.manifest import file_digest
from gpt2edge.manifest.records import MANIFEST_NAME
from gpt2edge.onnx_io.external_data import external_locations
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.folder import ModelFolder


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


def _relist(folder: Path, *names: str) -> None:
    """The attacker's step: the rewritten files' checksums put in the manifest (an unlisted file stays unlisted)."""
    m = _manifest(folder)
    for name in names:
        m["files"][name] = file_digest(folder / name)
    (folder / MANIFEST_NAME).write_text(json.dumps(m))


def _point_weights_at(folder: Path, graph: str, location: str) -> None:
    """Rewrite the external-data location of every external initializer of `graph` (proto bytes only)."""
    model = onnx.load(str(folder / graph), load_external_data=False)
    n = 0
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
                n += 1
    assert n, "the graph has no external data to redirect"
    (folder / graph).write_bytes(model.SerializeToString())
    _relist(folder, graph)


@pytest.fixture
def external(tiny_export, tmp_path) -> Path:
    """A copy of the tiny export whose weights are external data in an unlisted in-folder data.bin (the issue's
    attack), the .onnx re-listed with its new checksum."""
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_export, folder)
    g = _manifest(folder)["graph"]["file"]
    model = onnx.load(str(folder / g))
    onnx.save_model(model, str(folder / g), save_as_external_data=True, location="data.bin", size_threshold=1024)
    _relist(folder, g)
    return folder


def test_weights_in_an_unlisted_file_are_refused_before_any_session(external):
    # fast twice: a refused full check writes no verified record, whose match would skip the external-data scan
    for verify in (True, False, True):
        with pytest.raises(ModelFolderError, match=r"data\.bin.*not one of the graph files"):
            ModelFolder.open(external, verify=verify)
    with pytest.raises(ModelFolderError, match="data.bin"):
        Generator(external, verify=False)
    for extra in ([], ["--no-verify"]):
        r = CliRunner().invoke(main, ["generate", str(external), "-p", "hi", "-n", "2", *extra])
        assert r.exit_code == 1 and r.output.startswith("error: ") and "data.bin" in r.output, r.output


def test_listed_external_data_still_runs(external):
    """No false alarm: the same file listed as a graph file (what export writes for a graph over 2 GB) loads."""
    m = _manifest(external)
    m["graph"]["files"] = [m["graph"]["file"], "data.bin"]
    m["files"]["data.bin"] = file_digest(external / "data.bin")
    (external / MANIFEST_NAME).write_text(json.dumps(m))
    ModelFolder.open(external)
    assert len(Generator(external).generate("hello", max_new_tokens=2).token_ids) == 2


@pytest.mark.parametrize(
    "location",
    ["tokenizer.json", "manifest.json", "../outside.bin", "/etc/hostname", "sub/../data.bin", "", "data.bin\0x"],
)
def test_every_location_but_a_listed_graph_file_is_refused(external, location, tmp_path):
    (tmp_path / "outside.bin").write_bytes((external / "data.bin").read_bytes())
    g = _manifest(external)["graph"]["file"]
    m = _manifest(external)
    if location == "sub/../data.bin":  # normalises to a listed name only if data.bin were listed: list it
        m["graph"]["files"] = [g, "data.bin"]
        m["files"]["data.bin"] = file_digest(external / "data.bin")
        (external / MANIFEST_NAME).write_text(json.dumps(m))
        location = "sub/../tokenizer.json"
    _point_weights_at(external, g, location)
    for verify in (True, False):
        with pytest.raises(ModelFolderError, match="not one of the graph files"):
            ModelFolder.open(external, verify=verify)


def test_convert_refuses_unlisted_external_data(external, tmp_path):
    for fmt in ("ort", "genai"):
        with pytest.raises(ModelFolderError, match="data.bin"):
            convert_folder(external, tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()


def test_static_decode_graph_is_checked_too(tiny_checkpoint, tmp_path):
    """A static export has two graphs sharing weights.data; the second one is checked as well."""
    folder = tmp_path / "static"
    r = CliRunner().invoke(main, ["export", "-m", str(tiny_checkpoint), str(folder), "--static", "1x4x32"])
    assert r.exit_code == 0, r.output
    ModelFolder.open(folder)  # the listed weights.data is fine
    decode = _manifest(folder)["graph"]["static"]["decode_file"]
    shutil.copy(folder / "weights.data", folder / "copy.data")
    _point_weights_at(folder, decode, "copy.data")
    with pytest.raises(ModelFolderError, match=rf"{decode}.*copy\.data"):
        ModelFolder.open(folder, verify=False)


def test_locations_are_found_in_constants_subgraphs_and_sparse_tensors(tmp_path):
    """Tensors with external data hide in more places than the initializers; every one is found."""

    def ext(name: str, location: str) -> TensorProto:
        t = helper.make_tensor(name, TensorProto.FLOAT, [1], [0.0])
        t.ClearField("float_data")
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=location)
        t.external_data.add(key="length", value="4")
        return t

    const = helper.make_node("Constant", [], ["c"], value=ext("cv", "in_subgraph.bin"))
    then = helper.make_graph([const], "then", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])])
    other = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["c"])],
        "else",
        [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])],
        initializer=[ext("w", "in_else.bin")],
    )
    cond = helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)
    sparse = helper.make_sparse_tensor(
        ext("sv", "sparse.bin"), helper.make_tensor("si", TensorProto.INT64, [1], [0]), [4]
    )
    g = helper.make_graph(
        [cond],
        "main",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=[ext("top", "top.bin")],
        sparse_initializer=[sparse],
    )
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(g).SerializeToString())
    assert external_locations(path) == {"in_subgraph.bin", "in_else.bin", "sparse.bin", "top.bin"}


@pytest.mark.parametrize("data", [b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f", b"\x3a\x05abc"])
def test_a_graph_file_that_is_not_protobuf_is_one_error(tmp_path, data):
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    with pytest.raises(ModelFolderError, match="not a valid ONNX graph"):
        external_locations(path)


def _swap_head(folder: Path, head: str) -> None:
    m = _manifest(folder)
    m["graph"]["head"] = head
    (folder / MANIFEST_NAME).write_text(json.dumps(m))


@pytest.mark.parametrize(("fixture", "lie"), [("tiny_export", "all"), ("tiny_export_all", "last")])
def test_genai_convert_reads_the_real_head(request, tmp_path, fixture, lie):
    """A last-head graph recorded as `all` (and back) used to convert, then fail in onnxruntime-genai."""
    folder = tmp_path / "src"
    shutil.copytree(request.getfixturevalue(fixture), folder)
    _swap_head(folder, lie)
    with pytest.raises(ConvertError, match=f"records --head {lie} but the graph is a --head"):
        convert_folder(folder, tmp_path / "g", "genai")
    assert not (tmp_path / "g").exists()
    r = CliRunner().invoke(main, ["convert", str(folder), "-o", str(tmp_path / "g"), "--format", "genai"])
    assert r.exit_code == 1 and r.output.startswith("error: ") and "--head" in r.output, r.output


def test_external_scan_reads_no_weights(external):
    """The scan skips raw bytes: a graph with inline weights is parsed without reading them into Python."""
    g = _manifest(external)["graph"]["file"]
    assert external_locations(external / g) == {"data.bin"}
    assert np.isfinite((external / "data.bin").stat().st_size)
