"""Every field of manifest.json is checked for type and range at load: each field of a real export's manifest is
corrupted in turn (wrong type, a bool where a number goes, negative, null, missing) and must give one
ModelFolderError line that names the field and says how to fix it; the valid manifest still loads."""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.errors import ModelFolderError
from gpt2edge.manifest import FORMAT_VERSION, MANIFEST_NAME, PRECISIONS, Manifest, write_manifest

TRIM_KEPT = "kept_ids.npy"

# (path, kind, how it may be left out): "required", "optional" (missing: its default) or "nullable" (null too)
FIELDS = [
    (("format_version",), "version", "required"),
    (("tokenizer",), "text", "optional"),
    (("gpt2edge_version",), "text", "optional"),
    (("created",), "text", "optional"),
    (("versions",), "object", "optional"),
    (("validation",), "object", "nullable"),
    (("source",), "object", "optional"),
    (("source", "model"), "text", "nullable"),
    (("source", "path"), "text", "nullable"),
    (("source", "kind"), "text", "nullable"),
    (("source", "transformers"), "text", "nullable"),
    (("files",), "object", "required"),
    (("files", "config.json"), "object", "optional"),  # not loaded: it may go unlisted
    (("files", "config.json", "sha256"), "digest", "required"),
    (("files", "config.json", "size"), "count", "required"),
    (("dims",), "object", "required"),
    *((("dims", k), "positive", "required") for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")),
    (("dims", "head_dim"), "positive", "optional"),
    (("dims", "n_inner"), "positive", "optional"),
    (("dims", "layer_norm_epsilon"), "real", "optional"),
    (("dims", "activation"), "text", "optional"),
    (("dims", "attn_scale_by_layer"), "bool", "optional"),
    (("dims", "scale_attn_weights"), "bool", "optional"),
    (("graph",), "object", "required"),
    (("graph", "file"), "text", "required"),
    (("graph", "files"), "list", "optional"),
    (("graph", "opset"), "positive", "nullable"),
    (("graph", "head"), "choice", "optional"),
    (("graph", "kv_cache"), "choice", "optional"),
    (("graph", "attention"), "choice", "nullable"),
    (("graph", "precision"), "choice", "optional"),
    (("graph", "kv_dtype"), "choice", "optional"),
    (("graph", "format"), "choice", "optional"),
    (("graph", "tied_lm_head"), "bool", "optional"),
    (("graph", "decode_weight_bytes"), "count", "nullable"),
    (("graph", "inputs"), "list", "optional"),
    (("graph", "outputs"), "list", "optional"),
    (("graph", "inputs", 0, "name"), "text", "required"),
    (("graph", "inputs", 0, "dtype"), "text", "required"),
    (("graph", "inputs", 0, "shape"), "list", "required"),
    (("graph", "inputs", 0, "shape", 0), "dim", "required"),
    (("graph", "outputs", 0, "shape", 1), "dim", "required"),
    (("vocab",), "object", "nullable"),
    (("vocab", "kept_ids_file"), "text", "required"),
    (("vocab", "kept"), "positive", "required"),
    (("vocab", "full"), "positive", "required"),
]

BAD = {  # kind -> the wrong values tried
    "version": {"string": "1", "bool": True, "negative": -1, "zero": 0, "float": 1.0, "null": None},
    "positive": {"string": "2", "bool": True, "negative": -1, "zero": 0, "float": 2.5, "null": None},
    "count": {"string": "2", "bool": False, "negative": -1, "float": 2.5, "null": None},
    "real": {"string": "1e-5", "bool": True, "negative": -1e-5, "zero": 0, "nan": float("nan"), "null": None},
    "text": {"number": 5, "bool": True, "empty": "", "list": ["x"], "null": None},
    "choice": {"number": 5, "bool": True, "empty": "", "unknown": "bogus", "null": None},
    "digest": {"number": 5, "bool": True, "short": "abc", "upper": "A" * 64, "null": None},
    "bool": {"number": 1, "string": "true", "null": None},
    "list": {"string": "x", "object": {}, "null": None},
    "object": {"string": "x", "list": [], "number": 3, "null": None},
    "dim": {"bool": True, "negative": -1, "empty": "", "float": 1.5, "null": None},
}


def field_name(path: tuple) -> str:
    out = ""
    for prev, key in zip((None, *path), path):
        out += f"[{key}]" if isinstance(key, int) else f"[{key!r}]" if prev == "files" else f".{key}" if out else key
    return out


CASES = [
    (path, bad, how)
    for path, kind, how in FIELDS
    for bad in [*BAD[kind], *(["missing"] if kind != "dim" else [])]  # a list element cannot go missing
]


@pytest.fixture(scope="module")
def manifest(tiny_export) -> dict:
    """The tiny export's manifest, with a vocabulary record added (as trim-vocab writes) so that it is covered."""
    m = json.loads((tiny_export / MANIFEST_NAME).read_text())
    m["graph"].setdefault("format", "onnx")  # as convert writes it; an export leaves the default
    m["vocab"] = {"kept_ids_file": TRIM_KEPT, "kept": 300, "full": m["dims"]["vocab_size"]}
    m["files"][TRIM_KEPT] = {"sha256": "0" * 64, "size": 2528}
    Manifest.from_json(m)
    return m


def corrupt(m: dict, path: tuple, bad: str, kind: str) -> dict:
    m = copy.deepcopy(m)
    parent = m
    for key in path[:-1]:
        parent = parent[key]
    if bad == "missing":
        del parent[path[-1]]
    else:
        parent[path[-1]] = BAD[kind][bad]
    return m


def test_the_fields_list_covers_every_field_of_a_real_manifest(manifest):
    """A field the exporter adds later must join FIELDS (and the checks) before this passes."""
    listed = {p for p, _, _ in FIELDS}
    leaves = {(k,) for k in manifest if k != "format"}
    for section in ("dims", "graph", "source", "vocab"):
        leaves |= {(section, k) for k in manifest[section]}
    leaves |= {("files", "config.json", k) for k in manifest["files"]["config.json"]}
    leaves |= {("graph", "inputs", 0, k) for k in manifest["graph"]["inputs"][0]}
    assert leaves <= listed, sorted(leaves - listed)
    for path, _, _ in FIELDS:  # and each listed field is in the real manifest
        value = manifest
        for key in path:
            value = value[key]


@pytest.mark.parametrize(
    "path, bad, how", CASES, ids=[f"{field_name(p)}={b}" for p, b, _ in CASES]
)  # fmt: skip
def test_a_corrupted_field_is_named(manifest, path, bad, how):
    kind = next(k for p, k, _ in FIELDS if p == path)
    data = corrupt(manifest, path, bad, kind)
    allowed = (bad == "missing" and how in ("optional", "nullable")) or (bad == "null" and how == "nullable")
    if allowed:
        Manifest.from_json(data)  # the default (or null) is a valid value
        return
    with pytest.raises(ModelFolderError) as e:
        Manifest.from_json(data, "m/manifest.json")
    message = str(e.value)
    assert "\n" not in message and message.startswith("m/manifest.json: ")
    assert field_name(path) in message, message
    fix = "trim the model again" if path[0] == "vocab" else "re-export the model"
    assert fix in message, message


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 99])
def test_a_newer_format_says_to_upgrade(manifest, version):
    with pytest.raises(ModelFolderError, match="newer gpt2edge .* upgrade gpt2edge"):
        Manifest.from_json({**manifest, "format_version": version})


def test_typed_values_are_the_manifest_values(manifest):
    info = Manifest.from_json(manifest)
    assert info.format_version == FORMAT_VERSION
    assert info.dims.layer_norm_epsilon == manifest["dims"]["layer_norm_epsilon"]
    assert info.graph.opset == manifest["graph"]["opset"] and info.graph.precision in PRECISIONS
    assert info.files["config.json"].size == manifest["files"]["config.json"]["size"]


def test_quantize_modes_are_known_precisions():
    from gpt2edge.quantize.handler import MODES, WIDTH

    assert set(MODES) | set(WIDTH) <= set(PRECISIONS)


@pytest.mark.parametrize(
    "section, key, value",
    [("dims", "layer_norm_epsilon", "1e-5"), ("graph", "opset", True), ("graph", "decode_weight_bytes", "12")],
)
def test_the_cli_names_the_field_in_one_line(tiny_export, tmp_path, section, key, value):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_export, folder)
    m = json.loads((folder / MANIFEST_NAME).read_text())
    m[section][key] = value
    (folder / MANIFEST_NAME).write_text(json.dumps(m))
    for args in (["generate", folder, "-p", "x", "-n", "2"], ["bench", folder, "--repeat", "1"]):
        out = CliRunner().invoke(main, list(map(str, args)))
        assert out.exit_code == 1 and "Traceback" not in out.output, out.output
        assert out.stderr.count("\n") == 1 and f"{section}.{key}" in out.stderr, out.stderr


def test_write_manifest_refuses_what_the_reader_would(tiny_export, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_export, folder)
    m = json.loads((folder / MANIFEST_NAME).read_text())
    with pytest.raises(ModelFolderError, match="dims.activation"):
        write_manifest(folder, {**m, "dims": {**m["dims"], "activation": 3}})
    assert json.loads((folder / MANIFEST_NAME).read_text()) == m  # nothing written


def _copy_without(tiny_export, tmp_path, *path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_export, folder)
    m = json.loads((folder / MANIFEST_NAME).read_text())
    parent = m
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    (folder / MANIFEST_NAME).write_text(json.dumps(m))
    return folder


def test_optional_fields_read_raw_may_be_absent(tiny_export, tmp_path):
    """What the reader accepts, the commands that read the raw JSON accept too: no KeyError later."""
    folder = _copy_without(tiny_export, tmp_path, "graph", "inputs")
    out = CliRunner().invoke(
        main, ["quantize", str(folder), "-o", str(tmp_path / "q"), "--mode", "int8", "--no-report"]
    )
    assert out.exit_code == 0, out.output
    assert Manifest.from_json(json.loads((tmp_path / "q" / MANIFEST_NAME).read_text())).graph.precision == "int8"


def test_bench_vs_torch_without_a_recorded_source_asks_for_one(tiny_export, tmp_path):
    pytest.importorskip("torch")
    folder = _copy_without(tiny_export, tmp_path, "source")
    out = CliRunner().invoke(main, ["bench", str(folder), "--vs-torch", "--repeat", "1"])
    assert out.exit_code == 1 and "Traceback" not in out.output, out.output
    assert out.stderr.count("\n") == 1 and "pass -m SOURCE" in out.stderr, out.stderr


def _set_file_key(m: dict) -> None:
    m["files"]["../outside"] = m["files"].pop("config.json")


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m.update(tokenizer="/etc/passwd"), "tokenizer"),
        (lambda m: m["graph"].update(file="../x.onnx"), "graph.file"),
        (lambda m: m["graph"].update(files=["model.onnx", "a\\b"]), "graph.files[1]"),
        (lambda m: m["vocab"].update(kept_ids_file="../k.npy"), "vocab.kept_ids_file"),
        (_set_file_key, "files"),
    ],
    ids=["tokenizer", "graph.file", "graph.files", "vocab.kept_ids_file", "files"],
)
def test_a_path_outside_the_folder_names_its_field(manifest, edit, field):
    data = copy.deepcopy(manifest)
    edit(data)
    with pytest.raises(ModelFolderError) as e:
        Manifest.from_json(data, "m/manifest.json")
    assert f"m/manifest.json: {field}: the path" in str(e.value) and "re-export the model" in str(e.value)
