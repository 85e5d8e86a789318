"""Folder installs are signal-safe: a stopping signal in the window between moving OUT aside and moving the new
folder in no longer loses OUT (held back until the swap is done), and a SIGKILL there leaves a .OUT.old-* folder
that the next command puts back, never deletes.

The window is widened by an injected delay in a real subprocess; the signals are real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpt2edge.errors import OutputExistsError
from gpt2edge.folder import atomic_output_dir
from gpt2edge.folder.temp import clean_stale, host_tag
from gpt2edge.manifest.records import FORMAT, MANIFEST_NAME

REPO = Path(__file__).resolve().parents[2]

# replaces OUT with --force; the second rename (the new folder in) waits DELAY s after OUT was moved aside
WRITER = """
import sys, time
from pathlib import Path
import gpt2edge.folder as F
out, delay = Path(sys.argv[1]), float(sys.argv[2])
real = F.rename_noreplace
def slow(src, dst):
    if Path(dst) == out.resolve() and not out.exists():
        print("aside", flush=True)
        time.sleep(delay)
    real(src, dst)
F.rename_noreplace = slow
with F.atomic_output_dir(out, force=True) as tmp:
    (tmp / "MANIFEST").write_text('{"format": "%s"}')
    (tmp / "version").write_text("new")
"""


def _folder(path: Path, version: str) -> Path:
    path.mkdir()
    (path / MANIFEST_NAME).write_text(json.dumps({"format": FORMAT}))
    (path / "version").write_text(version)
    return path


def _swap_and_signal(out: Path, sig: int, delay: float = 1.0) -> subprocess.Popen:
    code = textwrap.dedent(WRITER).replace("MANIFEST", MANIFEST_NAME).replace("%s", FORMAT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(out), str(delay)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert p.stdout.readline().strip() == b"aside", p.stderr.read()
    assert not out.exists()  # the window: OUT is aside, the new folder not yet in
    os.kill(p.pid, sig)
    p.wait(timeout=30)
    return p


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_in_the_swap_window_is_held_until_the_swap_is_done(tmp_path, sig):
    out = _folder(tmp_path / "out", "old")
    p = _swap_and_signal(out, sig)
    assert p.returncode != 0  # the signal still acted: Ctrl-C / SIGTERM stop the program, after the swap
    assert (out / "version").read_text() == "new"
    assert json.loads((out / MANIFEST_NAME).read_text())["format"] == FORMAT
    # the replaced folder is discarded, or (SIGTERM, whose default action ends the process as the swap ends)
    # marked .del- for the next write to delete; nothing is left to restore
    assert not [n for n in _hidden(tmp_path) if ".del-" not in n]
    clean_stale(tmp_path)
    assert _hidden(tmp_path) == []


def test_sigkill_in_the_window_then_the_next_command_restores_out(tmp_path):
    """SIGKILL cannot be held back: OUT is left aside; the next write into the parent puts it back, and the
    request is judged against the restored OUT (here: it exists, and --force was not given)."""
    out = _folder(tmp_path / "out", "old")
    p = _swap_and_signal(out, signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL
    assert not out.exists() and any(".old-" in n for n in _hidden(tmp_path))
    with pytest.raises(OutputExistsError, match="already exists"), atomic_output_dir(out):
        pytest.fail("OUT was restored, so a write without --force is refused before it starts")
    assert (out / "version").read_text() == "old"
    assert not [n for n in _hidden(tmp_path) if ".old-" in n]
    clean_stale(tmp_path)  # the killed writer's half-built .tmp- folder goes with the next write
    assert _hidden(tmp_path) == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _stale(parent: Path, name: str, kind: str, child: str | None = None, version: str = "old") -> Path:
    """A temp folder named as gpt2edge names them, owned by a process that is gone."""
    stale = parent / f".{name}.{kind}-{host_tag()}-{_dead_pid()}-1-abcd1234"
    stale.mkdir()
    if child is not None:
        _folder(stale / child, version)
    return stale


@pytest.mark.parametrize("child", ["out", "x"])  # "x": the name older gpt2edge versions moved OUT aside under
def test_stale_aside_folder_is_restored_when_out_is_missing(tmp_path, child):
    stale = _stale(tmp_path, "out", "old", child)
    clean_stale(tmp_path)
    assert (tmp_path / "out" / "version").read_text() == "old"
    assert not stale.exists()


def test_stale_aside_folder_is_never_deleted_when_out_exists(tmp_path):
    _folder(tmp_path / "out", "current")
    stale = _stale(tmp_path, "out", "old", "out")
    discard = _stale(tmp_path, "out", "del", "out")  # marked replaced for good: deleted
    with atomic_output_dir(tmp_path / "other") as tmp:  # any write into the same parent cleans up
        (tmp / "f").write_text("x")
    assert (stale / "out" / "version").read_text() == "old"
    assert not discard.exists()
    assert (tmp_path / "out" / "version").read_text() == "current"
