"""Bad input for the sparse head: folders it does not support, options out of range, and a tampered table, each
one `error:` line and exit 1 before any work (or, loading, a typed error)."""

from __future__ import annotations

import json
import shutil

import pytest

from gpt2edge.errors import ChecksumError, ModelFolderError
from gpt2edge.runtime.generator import Generator
from tests.support import cli, one_error_line


@pytest.fixture(scope="module")
def sparse_folder(tiny_export, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "tiny-sparse"
    r = cli("sparse-head", tiny_export, "-o", out, "--rank", 8)
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.parametrize("rank", ["0", "64", "-3", "x"])
def test_rank_out_of_range(tiny_export, tmp_path, rank):
    r = cli("sparse-head", tiny_export, "-o", tmp_path / "o", "--rank", rank)
    assert r.exit_code != 0 and not (tmp_path / "o").exists()
    assert "Traceback" not in r.output and "rank" in r.output.lower()


def test_unsupported_folders(tiny_export_all, tiny_checkpoint, sparse_folder, tmp_path):
    one_error_line(cli("sparse-head", tiny_export_all, "-o", tmp_path / "a"), "--head all")
    one_error_line(cli("sparse-head", sparse_folder, "-o", tmp_path / "b"), "already has a sparse head")
    static = tmp_path / "static"
    assert cli("export", "-m", tiny_checkpoint, static, "--static", "1x4x32", "--no-validate").exit_code == 0
    one_error_line(cli("sparse-head", static, "-o", tmp_path / "c"), "static-shape")
    one_error_line(cli("sparse-head", tmp_path / "missing", "-o", tmp_path / "d"), "does not exist")
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_trimmed_and_fp16_refused(tiny_export, tmp_path):
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps(list(range(300))))
    assert cli("trim-vocab", tiny_export, "-o", tmp_path / "t", "--keep-ids", keep, "--no-report").exit_code == 0
    one_error_line(cli("sparse-head", tmp_path / "t", "-o", tmp_path / "a"), "vocabulary-trimmed")
    assert cli("quantize", tiny_export, "-o", tmp_path / "h", "--mode", "fp16", "--no-report").exit_code == 0
    one_error_line(cli("sparse-head", tmp_path / "h", "-o", tmp_path / "b"), "fp16")


def test_tampered_table_caught(sparse_folder, tmp_path):
    """An edited bound table fails its checksum on open; loaded without verification, the load-time check
    that the bounds hold is what refuses it (a bound too small would certify a wrong token)."""
    bad = tmp_path / "bad"
    shutil.copytree(sparse_folder, bad)
    import onnx
    from onnx import numpy_helper

    bound = onnx.load(str(bad / "bound.onnx"))
    for i, init in enumerate(bound.graph.initializer):
        if init.name == "bound_table":  # its eps row (per-row error bounds) 100x too small: certifies wrong tokens
            table = numpy_helper.to_array(init).copy()
            table[-2] /= 100
            bound.graph.initializer[i].CopyFrom(numpy_helper.from_array(table, init.name))
    onnx.save(bound, str(bad / "bound.onnx"))
    with pytest.raises(ChecksumError, match="checksum"):
        Generator(bad)
    one_error_line(cli("generate", bad, "-p", "Hi", "-n", "2"), "checksum")
    with pytest.raises(ModelFolderError, match="does not bound"):
        Generator(bad, verify=False)
    (bad / "sparse_head.npz").write_bytes(b"not a zip")
    with pytest.raises(ModelFolderError, match="cannot be read"):
        Generator(bad, verify=False)


@pytest.mark.parametrize("fmt", ["web", "genai"])
def test_convert_for_other_runtimes_refused(sparse_folder, tmp_path, fmt):
    """The browser runtime and onnxruntime-genai do not run a sparse head (its body graph returns the hidden state
    and takes switches they do not feed): one line, naming the parent, nothing written."""
    r = cli("convert", sparse_folder, "--format", fmt, "-o", tmp_path / "o")
    one_error_line(r, "sparse LM head")
    assert "parent" in r.output and not (tmp_path / "o").exists()


def test_convert_to_ort_format_runs(sparse_folder, tiny_export, tmp_path):
    """--format ort keeps it a gpt2edge folder: the same greedy tokens as the parent (a random table: the native
    step reads on past its candidates and leaves some rows out, whose logits then set the bar)."""
    r = cli("convert", sparse_folder, "--format", "ort", "-o", tmp_path / "ort")
    assert r.exit_code == 0, r.output
    kw = dict(max_new_tokens=12, ignore_eos=True)
    ids = Generator(tmp_path / "ort").generate("The", **kw).token_ids
    assert ids == Generator(tiny_export).generate("The", **kw).token_ids
