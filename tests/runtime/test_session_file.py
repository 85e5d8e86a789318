"""Save and restore a session (Session.save/load, `-i`'s /save and /load; gpt2edge.runtime.session_file): the
restored session continues with exactly the tokens the unsaved one produces, on both graph kinds, greedy and
seeded; a file from another folder or format, truncated, tampered or not a session file is refused in one line
and leaves the session unchanged; a save is atomic and touches no other file."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2edge.errors import GenerationError, SessionFileError
from gpt2edge.runtime import Generator
from gpt2edge.runtime.session_file import MAGIC, read_session

REPO = Path(__file__).resolve().parents[2]
GREEDY = dict(ignore_eos=True, do_sample=False, max_new_tokens=10)
SEEDED = dict(ignore_eos=True, do_sample=True, temperature=1.0, seed=7, max_new_tokens=10)


@pytest.fixture(scope="module", params=["concat", "shared"])
def gen(request) -> Generator:
    return Generator(request.getfixturevalue("tiny_export" if request.param == "concat" else "tiny_export_shared"))


@pytest.mark.parametrize("kw", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_restored_session_continues_with_the_same_tokens(gen, tmp_path, kw):
    a = gen.session()
    a.generate("The river rose and", **kw)
    path = a.save(tmp_path / "s.g2s")
    saved_ids = a.token_ids
    turn2 = a.generate(" the city", **kw).token_ids
    turn3 = a.generate(" then", **kw).token_ids

    b = gen.session()
    b.generate("something else entirely", **GREEDY)  # a used session: load replaces its context and cache
    b.load(path)
    assert b.token_ids == saved_ids
    assert b.generate(" the city", **kw).token_ids == turn2
    assert b.generate(" then", **kw).token_ids == turn3
    assert b.last_prefill_tokens == a.last_prefill_tokens  # the restored cache is used, not rebuilt


def test_without_io_binding_and_an_empty_session(tiny_export, tmp_path):
    gen = Generator(tiny_export, io_binding=False)
    a = gen.session()
    empty = a.save(tmp_path / "empty")
    a.generate("The river", **GREEDY)
    a.save(tmp_path / "one")
    want = a.generate(" rose", **GREEDY).token_ids
    b = gen.session()
    b.load(tmp_path / "one")
    assert b.generate(" rose", **GREEDY).token_ids == want
    b.load(empty)
    assert (
        b.token_ids == []
        and b.generate("The river", **GREEDY).token_ids == gen.session().generate("The river", **GREEDY).token_ids
    )


@pytest.fixture(scope="module")
def saved(tiny_export, tmp_path_factory) -> tuple[Generator, Path, bytes]:
    gen = Generator(tiny_export)
    s = gen.session()
    s.generate("The river rose and", **GREEDY)
    path = s.save(tmp_path_factory.mktemp("saved") / "s.g2s")
    return gen, path, path.read_bytes()


def refused(gen: Generator, path: Path) -> str:
    """Load `path` into a session with a context of its own: the error's one line; the session unchanged."""
    s = gen.session()
    s.generate("Unchanged context", **GREEDY)
    before, want = s.token_ids, gen.session()
    want.generate("Unchanged context", **GREEDY)
    with pytest.raises(SessionFileError) as e:
        s.load(path)
    assert s.token_ids == before
    assert s.generate(" goes on", **GREEDY).token_ids == want.generate(" goes on", **GREEDY).token_ids
    assert "\n" not in str(e.value)
    return str(e.value)


def header_end(data: bytes) -> int:
    (n,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
    return len(MAGIC) + 8 + n


def test_truncated_files_are_refused(saved, tmp_path):
    gen, _, data = saved
    for cut in (0, 5, len(MAGIC) + 3, header_end(data) - 1, header_end(data) + 4, len(data) - 1):
        bad = tmp_path / f"cut{cut}"
        bad.write_bytes(data[:cut])
        msg = refused(gen, bad)
        assert "truncated" in msg or "not a gpt2edge session file" in msg, (cut, msg)
    (tmp_path / "long").write_bytes(data + b"\0")
    assert "extra bytes" in refused(gen, tmp_path / "long")


def test_a_flipped_payload_byte_is_refused(saved, tmp_path):
    gen, _, data = saved
    for at in (header_end(data), header_end(data) + 40, len(data) - 1):  # a token id, a cache entry, the last
        bad = bytearray(data)
        bad[at] ^= 0x01
        (tmp_path / "bad").write_bytes(bytes(bad))
        assert "does not match its sha256" in refused(gen, tmp_path / "bad")


def rewrite_header(data: bytes, **change) -> bytes:
    end = header_end(data)
    header = {**json.loads(data[len(MAGIC) + 8 : end]), **change}
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + data[end:]


def test_another_folder_format_or_oversized_header_is_refused(saved, tiny_export_shared, tmp_path):
    gen, path, data = saved
    other = Generator(tiny_export_shared)  # another export of the same model: another manifest
    assert "another export folder" in refused(other, path)
    (tmp_path / "v").write_bytes(rewrite_header(data, format_version=99))
    assert "format 99" in refused(gen, tmp_path / "v")
    # a header that claims more than the model's cache holds is refused before any array is read
    (tmp_path / "big").write_bytes(rewrite_header(data, tokens=10**9, cached=10**9, payload_bytes=10**15))
    assert "is damaged" in refused(gen, tmp_path / "big")
    (tmp_path / "len").write_bytes(MAGIC + struct.pack("<Q", 2**62) + b"{}")
    assert "header claims" in refused(gen, tmp_path / "len")


def test_garbage_and_non_files_are_refused(saved, tmp_path):
    gen, _, _ = saved
    (tmp_path / "junk").write_bytes(os.urandom(300))
    assert "not a gpt2edge session file" in refused(gen, tmp_path / "junk")
    (tmp_path / "json").write_bytes(MAGIC + struct.pack("<Q", 3) + b"[1]")
    assert "not a JSON object" in refused(gen, tmp_path / "json")
    assert "is not a file" in refused(gen, tmp_path)
    assert "is not a file" in refused(gen, tmp_path / "missing")


def test_save_is_atomic_and_refuses_bad_targets(saved, tmp_path):
    gen, path, data = saved
    s = gen.session()
    s.generate("The river rose and", **GREEDY)
    target = tmp_path / "s.g2s"
    target.write_bytes(b"old")
    neighbour = tmp_path / "keep.txt"
    neighbour.write_text("mine")
    s.save(target)
    assert target.read_bytes() == data  # the same state gives the same bytes (deterministic)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "s.g2s"]  # no temp file left
    assert neighbour.read_text() == "mine"
    with pytest.raises(SessionFileError, match="is a directory"):
        s.save(tmp_path)
    with pytest.raises(SessionFileError, match="does not exist"):
        s.save(tmp_path / "nope" / "s.g2s")
    assert read_session(target, s.lm).tokens == s.token_ids


def run_cli(export: Path, stdin: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    cmd = [sys.executable, "-m", "gpt2edge.cli", "generate", str(export), "-i", *args]
    return subprocess.run(cmd, input=stdin.encode(), capture_output=True, timeout=120, env=env)


def test_cli_interactive_save_and_load(tiny_export, tmp_path):
    s = Generator(tiny_export).session()
    kw = dict(max_new_tokens=8, do_sample=False)
    a1, a2 = s.generate("The river rose", **kw).text, s.generate(" and the city", **kw).text
    f = tmp_path / "chat.g2s"
    first = run_cli(tiny_export, f"The river rose\n/save {f}\n and the city\n", "-n", "8")
    assert first.returncode == 0, first.stderr.decode()
    assert first.stdout.decode() == f"{a1}\n{a2}\n"
    assert f" tokens to {f}]" in first.stderr.decode()
    junk = tmp_path / "junk"
    junk.write_bytes(b"junk")
    second = run_cli(tiny_export, f"/load {junk}\n/load {f}\n and the city\n/save\n/load\n", "-n", "8")
    err = second.stderr.decode()
    assert second.returncode == 0, err
    assert second.stdout.decode() == f"{a2}\n"  # the restored session goes on as the saved one did
    assert f"error: {junk} is not a gpt2edge session file (no session header)." in err.splitlines()
    assert "error: /save needs a file name" in err and "error: /load needs a file name" in err
    assert f" tokens from {f}]" in err and "Traceback" not in err


def test_save_and_load_refuse_while_a_stream_is_open(saved):
    gen, path, _ = saved
    s = gen.session()
    pieces = s.stream("The river", **GREEDY)
    next(pieces)
    for call in (lambda: s.save(path), lambda: s.load(path)):
        with pytest.raises(GenerationError, match="a stream is still open"):
            call()
    pieces.close()
    s.load(path)  # once the turn has ended
