"""The verified record: a second open of an unchanged folder hashes nothing, any stat change hashes again and a
wrong checksum is refused as before, a lying record is caught by verify="full" / --verify, and a corrupt record
or an unwritable cache directory only costs the full check."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from click.testing import CliRunner

import gpt2edge.manifest as manifest_mod
from gpt2edge.cli import main
from gpt2edge.errors import ArgumentTypeError, ChecksumError, ModelFolderError
from gpt2edge.manifest import verified
from gpt2edge.runtime.model.folder import ModelFolder


@pytest.fixture
def folder(tiny_export, tmp_path, monkeypatch):
    """A private copy of the tiny export, and a cache directory of this test's own. Files settle after 50 ms
    here (2 s by default), and the copy is older than that: a later rewrite lands on another clock tick."""
    monkeypatch.delenv("GPT2EDGE_CACHE_DIR", raising=False)  # the suite's own; here the XDG rule is under test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(verified, "SETTLE_NS", 50_000_000)
    out = tmp_path / "model"
    shutil.copytree(tiny_export, out)
    time.sleep(0.1)
    return out


@pytest.fixture
def hashed(monkeypatch):
    """The files the sha256 check reads, in order (file_digest is what verify_files hashes with)."""
    calls: list[str] = []
    real = manifest_mod.file_digest

    def counting(path):
        calls.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(manifest_mod, "file_digest", counting)
    return calls


def records():
    return sorted((verified.cache_root() / "verified").glob("*.json"))


def rewrite_keeping_size_and_mtime(path):
    """Flip one byte in place and restore the mtime: what a record keyed by size and mtime alone would miss."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_second_open_reads_no_weights(folder, hashed):
    ModelFolder.open(folder)
    assert "model.onnx" in hashed  # the first open hashes every file...
    assert len(records()) == 1 and not list(folder.rglob("*.part"))
    listed = json.loads((folder / "manifest.json").read_text())["files"]
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == sorted(
        [*listed, "manifest.json"]
    )  # nothing written into the model folder
    hashed.clear()
    ModelFolder.open(folder)
    ModelFolder.open(folder, verify="fast")
    assert hashed == []  # ...the next ones none
    ModelFolder.open(folder, verify="full")
    assert "model.onnx" in hashed  # full always hashes


def test_size_or_mtime_change_hashes_again_and_refuses(folder, hashed):
    ModelFolder.open(folder)
    graph = folder / "model.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))  # same size, a new mtime
    hashed.clear()
    with pytest.raises(ChecksumError, match="does not match its manifest checksum"):
        ModelFolder.open(folder)
    assert "model.onnx" in hashed
    graph.write_bytes(bytes(data) + b"\0")  # another size
    with pytest.raises(ChecksumError):
        ModelFolder.open(folder)


def test_utime_restored_rewrite_is_still_caught(folder):
    """os.utime restores mtime, not ctime: the fast check (which includes ctime) hashes again and refuses."""
    ModelFolder.open(folder)
    rewrite_keeping_size_and_mtime(folder / "model.onnx")
    with pytest.raises(ChecksumError):
        ModelFolder.open(folder)


def test_a_lying_record_passes_fast_and_full_catches_it(folder, hashed):
    """The trust boundary docs/safety.md states: the fast check trusts a record whose stat fields all match. A
    record forged to match the tampered files (or a rewrite that restores ctime too) passes it; full does not."""
    ModelFolder.open(folder)
    (path,) = records()
    rewrite_keeping_size_and_mtime(folder / "model.onnx")
    rec = json.loads(path.read_text())
    rec["files"] = verified._stats(folder, manifest_mod.load_manifest(folder))  # the lie: today's stat, old sha256
    path.write_text(json.dumps(rec))
    hashed.clear()
    ModelFolder.open(folder)
    assert hashed == []
    with pytest.raises(ChecksumError):
        ModelFolder.open(folder, verify="full")
    result = CliRunner().invoke(main, ["generate", str(folder), "-p", "hi", "-n", "1", "--verify"])
    assert result.exit_code == 1 and "does not match its manifest checksum" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"version": 1}', b"[]", b"\xff\xfe", b" " * (2 << 20)])
def test_corrupt_record_is_ignored(folder, hashed, content):
    ModelFolder.open(folder)
    (path,) = records()
    path.write_bytes(content)
    hashed.clear()
    ModelFolder.open(folder)
    assert "model.onnx" in hashed  # hashed again, and the record rewritten
    hashed.clear()
    ModelFolder.open(folder)
    assert hashed == []


def test_unwritable_cache_still_opens(folder, hashed, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails for root too
    ModelFolder.open(folder)
    hashed.clear()
    ModelFolder.open(folder)
    assert "model.onnx" in hashed  # no record: every open hashes, none fails
    if os.geteuid() != 0:  # a read-only directory (root writes through the mode bits)
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        monkeypatch.setenv("XDG_CACHE_HOME", str(ro))
        ModelFolder.open(folder)
        assert not list(ro.rglob("*.json"))


def test_a_record_is_per_folder_and_manifest(folder, tmp_path, hashed):
    ModelFolder.open(folder)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    time.sleep(0.1)  # settled
    hashed.clear()
    ModelFolder.open(other)  # another path (and inodes): its own full check
    assert "model.onnx" in hashed and len(records()) == 2


def test_a_just_written_folder_gets_no_record_yet(folder, hashed, monkeypatch):
    """A file changed within the settle time could change again on the same clock tick unseen: hash it again."""
    monkeypatch.setattr(verified, "SETTLE_NS", 10**12)  # everything is "recent"
    ModelFolder.open(folder)
    assert records() == []
    hashed.clear()
    ModelFolder.open(folder)
    assert "model.onnx" in hashed


def test_gpt2edge_cache_dir_wins(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2EDGE_CACHE_DIR", str(tmp_path / "mine"))
    ModelFolder.open(folder)
    assert len(list((tmp_path / "mine" / "verified").glob("*.json"))) == 1
    assert not (tmp_path / "cache").exists()


def test_bad_verify_values(folder):
    with pytest.raises(ModelFolderError, match="verify must be"):
        ModelFolder.open(folder, verify="quick")
    with pytest.raises(ArgumentTypeError, match="verify must be"):
        ModelFolder.open(folder, verify=1)


def test_cli_verify_and_no_verify(folder, hashed):
    runner = CliRunner()
    ok = runner.invoke(main, ["score", str(folder), "--verify", "--json"], input="hello world, hello")
    assert ok.exit_code == 0, ok.output
    assert "model.onnx" in hashed
    hashed.clear()
    ok = runner.invoke(main, ["score", str(folder), "--json"], input="hello world, hello")
    assert ok.exit_code == 0 and hashed == []
    both = runner.invoke(main, ["generate", str(folder), "-p", "hi", "--verify", "--no-verify"])
    assert both.exit_code == 2 and "contradict" in both.output
    for cmd in ("generate", "score", "serve"):
        assert "--verify" in runner.invoke(main, [cmd, "--help"]).output
