"""Every file a command writes gets the mode a plain open() gives under the user's umask, and every folder the
mode of a plain mkdir(): onnx's external-data writer creates its .data file 0600 and copy2 keeps a source file's
mode, so a folder written for a service account would be half unreadable to it. Mode bits are checked, not
access (the tests may run as root)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

import gpt2edge.quantize.graph as quantize_graph
from gpt2edge.cli import main

UMASK = 0o027  # neither the usual 022 nor what a private writer gives (0600 files, 0700 folders)


@pytest.fixture
def umask():
    old = os.umask(UMASK)
    try:
        yield UMASK
    finally:
        os.umask(old)


@pytest.fixture
def external_data(monkeypatch):
    """Graphs written with their weights in a .data file, as models over 2 GB are (onnx's writer makes it 0600)."""
    monkeypatch.setattr(quantize_graph, "EXTERNAL_DATA_THRESHOLD", 0)


def modes(folder: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(folder.stat().st_mode)}
    for p in sorted(folder.rglob("*")):
        out[p.relative_to(folder).as_posix()] = stat.S_IMODE(p.lstat().st_mode)
    return out


def assert_usual_modes(folder: Path, mask: int) -> None:
    got = modes(folder)
    want = {
        rel: (0o777 if (folder / rel).is_dir() else 0o666) & ~mask for rel in got
    }  # fmt: skip
    assert got == want, {rel: (oct(got[rel]), oct(want[rel])) for rel in got if got[rel] != want[rel]}


def run(*args) -> None:
    out = CliRunner().invoke(main, list(map(str, args)))
    assert out.exit_code == 0, out.output


def test_quantize_with_external_data(tiny_export, tmp_path, umask, external_data):
    run("quantize", tiny_export, "-o", tmp_path / "q", "--mode", "int8", "--no-report")
    assert (tmp_path / "q" / "model.onnx.data").is_file()  # the writer that made it 0600 did run
    assert_usual_modes(tmp_path / "q", umask)


def test_trim_vocab_with_external_data(tiny_export, tmp_path, umask, external_data):
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(map(str, range(300))))
    run("trim-vocab", tiny_export, "-o", tmp_path / "t", "--keep-ids", ids, "--no-report")
    assert (tmp_path / "t" / "model.onnx.data").is_file()
    assert_usual_modes(tmp_path / "t", umask)


@pytest.mark.parametrize("fmt", ["ort", "genai"])
def test_convert(tiny_export, tmp_path, umask, external_data, fmt):
    run("convert", tiny_export, "-o", tmp_path / fmt, "--format", fmt)
    assert_usual_modes(tmp_path / fmt, umask)


def test_convert_does_not_copy_a_private_source_mode(tiny_export, tmp_path, umask):
    """copy2 carried a 0600 tokenizer (a folder written before this fix) into the new folder."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_export, src)
    (src / "tokenizer.json").chmod(0o600)
    run("convert", src, "-o", tmp_path / "ort", "--format", "ort")
    assert_usual_modes(tmp_path / "ort", umask)


def test_export_and_random_checkpoint(tiny_checkpoint, tmp_path, umask):
    run("random-checkpoint", tmp_path / "ckpt")
    assert_usual_modes(tmp_path / "ckpt", umask)
    run("export", "-m", tiny_checkpoint, tmp_path / "e", "--no-validate")
    assert_usual_modes(tmp_path / "e", umask)
