"""Every derived folder kind (gpt2edge.folder.derive, Manifest.derived) writes a manifest with what a derived
folder must carry: its record with the parent (resolved path, precision, the parent graph files' sha256), every
file checksummed and verifying, the version and time of writing, and none of the parent's fields that describe
the parent's own graph (DERIVED_DROPS; the quality report unless the kind keeps it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import gpt2edge
from gpt2edge.convert.handler import convert_folder
from gpt2edge.manifest import load_manifest, verify_files, write_manifest
from gpt2edge.manifest.records import DERIVED_DROPS, DERIVED_KINDS, FORMAT_VERSION, MANIFEST_NAME
from gpt2edge.quantize.handler import make_recipe, quantize_model
from gpt2edge.sparse.approx_handler import cluster_sparse_head
from gpt2edge.sparse.handler import sparse_head
from gpt2edge.trim.handler import trim_vocab


@pytest.fixture(scope="module")
def parents(tiny_export, tmp_path_factory) -> dict[str, Path]:
    """An fp32 and an int8 parent whose manifests both hold a validation (the export's) and a quality report
    (the int8 folder's own), so that every kind has both to drop or keep."""
    root = tmp_path_factory.mktemp("derived")
    quantize_model(tiny_export, root / "int8-made", make_recipe("int8"), log=None)
    validation = load_manifest(tiny_export).raw["validation"]
    quality = load_manifest(root / "int8-made").raw["quality"]
    out = {}
    for name, made in (("fp32", tiny_export), ("int8", root / "int8-made")):
        out[name] = root / name
        shutil.copytree(made, out[name])
        manifest = {**load_manifest(out[name]).raw, "validation": validation, "quality": quality}
        write_manifest(out[name], manifest)
    return out


def _trim(src: Path, out: Path) -> None:
    ids = out.parent / f"{out.name}-ids.json"
    ids.write_text(json.dumps(list(range(300))))  # the byte tokens and more; eos (the last id) is added
    trim_vocab(src, out, keep_ids=ids, report=False)


# (kind, what is derived, how): every kind of DERIVED_KINDS at least once
CASES = {
    "quantize": ("quantize", lambda src, out: quantize_model(src, out, make_recipe("int4"), report=False)),
    "trim-vocab": ("trim-vocab", _trim),
    "sparse-head": ("sparse-head", lambda src, out: sparse_head(src, out, rank=4, candidates_k=32)),
    "sparse-head cluster": (
        "sparse-head",
        lambda src, out: cluster_sparse_head(src, out, clusters=16, probe=4, report=False, log=None),
    ),
    "convert ort": ("convert", lambda src, out: convert_folder(src, out, "ort")),
    "convert genai": ("convert", lambda src, out: convert_folder(src, out, "genai")),
    "convert web": ("convert", lambda src, out: convert_folder(src, out, "web")),
}


def test_every_kind_is_walked():
    assert {kind for kind, _ in CASES.values()} == set(DERIVED_KINDS)


@pytest.mark.parametrize("case", list(CASES))
def test_derived_manifest_carries_its_parent_and_drops_what_described_the_parent(case, parents, tmp_path):
    kind, derive = CASES[case]
    src = parents["fp32" if kind == "quantize" else "int8"]  # quantize needs an fp32 parent
    parent = load_manifest(src)
    out = tmp_path / "out"
    derive(src, out)

    m = load_manifest(out)  # typed: the reader accepts what the writer wrote
    raw = m.raw
    record = raw[DERIVED_KINDS[kind].record]
    assert record["parent"] == {
        "path": str(src.resolve()),
        "precision": parent.graph.precision,
        "sha256": {f: parent.files[f].sha256 for f in parent.graph.files},
    }
    assert raw["gpt2edge_version"] == gpt2edge.__version__ and raw["created"]
    assert m.format_version == FORMAT_VERSION
    # every file of the folder is listed with its checksum, and they verify
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != MANIFEST_NAME}
    assert set(m.files) == on_disk
    verify_files(out, m)
    # what described the parent's graph is not carried over
    assert "validation" in parent.raw and "quality" in parent.raw  # the parent has both to drop
    for field in DERIVED_DROPS:
        if field in ("files", "format", "format_version"):
            continue  # written anew (checked above)
        assert field not in raw, field
    if DERIVED_KINDS[kind].keeps_quality:
        assert raw["quality"] == parent.raw["quality"]  # the same graph in another format: its report holds
    else:
        assert raw.get("quality") != parent.raw["quality"]
    # what the derivation did not touch is the parent's (its source, dims, tokenizer)
    assert raw["source"] == parent.raw["source"] and raw["dims"] == parent.raw["dims"]
    assert raw["tokenizer"] == parent.raw["tokenizer"]
    assert (out / m.tokenizer).read_bytes() == (src / parent.tokenizer).read_bytes()
