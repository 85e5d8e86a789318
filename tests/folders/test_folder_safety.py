"""Output folders and manifests are safe: nothing outside what --force authorises is replaced, nothing outside
the model folder is read, killed runs leave nothing for long, and failures are one clear line."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpt2edge import folder as folder_mod
from gpt2edge.errors import ModelFolderError, OutputExistsError
from gpt2edge.export import exporter, onnx_graph
from gpt2edge.folder import derive  # the skeleton writes a derived folder's manifest
from gpt2edge.manifest import MANIFEST_NAME, file_digest, load_manifest
from gpt2edge.quantize.handler import make_recipe, quantize_model
from gpt2edge.runtime import Generator, ModelFolder
from tests.support import cli

REPO = Path(__file__).resolve().parents[2]


def assert_one_line_error(result, *phrases):
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: "), result.output
    for phrase in phrases:
        assert phrase.lower() in line.lower(), line


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def quick_quantize(src, out, **kw):
    return quantize_model(src, out, make_recipe("int8"), report=False, **kw)


# --- 2. the final rename never replaces what --force did not authorise at that moment ----------------------


def make_user_folder(out: Path, what: str) -> None:
    """Something a user (or a second export) put at OUT while a write was running."""
    if what == "file":
        out.write_text("mine")
        return
    out.mkdir()
    if what == "folder":
        (out / "keep.txt").write_text("mine")
    elif what == "export":
        (out / MANIFEST_NAME).write_text(json.dumps({"format": "gpt2edge-export", "files": {}}))


@pytest.mark.parametrize("what", ["empty", "folder", "file", "export"])
def test_quantize_does_not_replace_what_appeared_meanwhile(tiny_export, tmp_path, monkeypatch, what):
    out = tmp_path / "q"
    real_write = derive.write_manifest

    def write_then_race(folder, manifest):
        make_user_folder(out, what)  # appears after the start-of-run check, before the final rename
        return real_write(folder, manifest)

    monkeypatch.setattr(derive, "write_manifest", write_then_race)
    with pytest.raises(OutputExistsError, match="appeared while"):
        quick_quantize(tiny_export, out)
    if what == "file":
        assert out.read_text() == "mine"
    else:  # empty stays empty (os.rename onto an empty folder would have succeeded), the others untouched
        names = {"empty": [], "folder": ["keep.txt"], "export": [MANIFEST_NAME]}[what]
        assert sorted(p.name for p in out.iterdir()) == names
    assert hidden(tmp_path) == []


def test_two_exports_to_one_folder_do_not_both_succeed(tiny_checkpoint, tiny_export, tmp_path, monkeypatch):
    """The second export finishes while the first runs: the first must fail, not delete the second's result."""
    out = tmp_path / "out"
    real_write = exporter.write_manifest

    def other_export_finishes_first(folder, manifest):
        shutil.copytree(tiny_export, out)
        return real_write(folder, manifest)

    monkeypatch.setattr(exporter, "write_manifest", other_export_finishes_first)
    r = cli("export", "-m", tiny_checkpoint, out, "--no-validate")
    assert_one_line_error(r, "appeared while", "--force")
    assert snapshot(out) == snapshot(tiny_export)
    assert hidden(tmp_path) == []


def test_force_rechecks_at_the_final_moment(tiny_export, tmp_path, monkeypatch):
    """--force was given for an old export; if a user folder sits there at the end, it is not deleted."""
    out = tmp_path / "q"
    shutil.copytree(tiny_export, out)  # a gpt2edge folder: what --force authorises
    real_write = derive.write_manifest

    def swap_in_user_data(folder, manifest):
        shutil.rmtree(out)
        make_user_folder(out, "folder")
        return real_write(folder, manifest)

    monkeypatch.setattr(derive, "write_manifest", swap_in_user_data)
    with pytest.raises(OutputExistsError, match="appeared while"):
        quick_quantize(tiny_export, out, force=True)
    assert (out / "keep.txt").read_text() == "mine"
    assert hidden(tmp_path) == []


def test_force_replaces_an_export_and_an_empty_folder(tiny_export, tmp_path):
    for out in (tmp_path / "old-export", tmp_path / "empty"):
        if out.name == "old-export":
            shutil.copytree(tiny_export, out)
        else:
            out.mkdir()
        quick_quantize(tiny_export, out, force=True)
        assert load_manifest(out).raw["graph"]["precision"] == "int8"
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("native", [True, False])
def test_no_replace_rename(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setattr("gpt2edge.folder.swap._renameat2", lambda: None)  # the mkdir-based fallback
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "a").write_text("new")
    dst.mkdir()  # empty: os.rename would replace it
    with pytest.raises(FileExistsError):
        folder_mod.rename_noreplace(src, dst)
    assert (src / "a").exists() and list(dst.iterdir()) == []
    dst.rmdir()
    folder_mod.rename_noreplace(src, dst)
    assert (dst / "a").read_text() == "new" and not src.exists()


# --- 3. OUT never overlaps the input; --force replaces only gpt2edge folders ------------------------------


def overlaps(base: Path, tmp_path: Path) -> list[tuple[str, Path]]:
    """(case, OUT) pairs that overlap the input folder `base`, including through a symlink."""
    link = tmp_path / "link"
    link.symlink_to(base, target_is_directory=True)
    return [("equal", base), ("inside", base / "sub"), ("holds", base.parent), ("symlink", link)]


def test_export_refuses_out_that_overlaps_the_source(tiny_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpts" / "tiny"
    shutil.copytree(tiny_checkpoint, ckpt)
    before = snapshot(ckpt)
    for case, out in overlaps(ckpt, tmp_path):
        r = cli("export", "-m", ckpt, out, "--force", "--no-validate")
        assert_one_line_error(r, "input")
        assert snapshot(ckpt) == before, case
    assert not (ckpt / "sub").exists()
    # the --tokenizer folder is an input too
    r = cli("export", "-m", tiny_checkpoint, ckpt, "--tokenizer", ckpt, "--force", "--no-validate")
    assert_one_line_error(r, "input")
    assert snapshot(ckpt) == before


def test_quantize_refuses_out_that_overlaps_the_model(tiny_export, tmp_path):
    src = tmp_path / "exports" / "fp32"
    shutil.copytree(tiny_export, src)
    before = snapshot(src)
    for case, out in overlaps(src, tmp_path):
        r = cli("quantize", src, "-o", out, "--mode", "int8", "--force", "--no-report")
        assert_one_line_error(r, "input")
        assert snapshot(src) == before, case


def test_force_keeps_a_folder_that_is_not_a_gpt2edge_export(tiny_checkpoint, tiny_export, tmp_path):
    out = tmp_path / "photos"
    make_user_folder(out, "folder")
    r = cli("quantize", tiny_export, "-o", out, "--mode", "int8", "--force", "--no-report")
    assert_one_line_error(r, "not a gpt2edge folder")
    r = cli("export", "-m", tiny_checkpoint, out, "--force", "--no-validate")
    assert_one_line_error(r, "not a gpt2edge folder")
    assert (out / "keep.txt").read_text() == "mine"


# --- 4. every path a manifest names stays inside the folder, and what is loaded is listed ------------------


def copy_export(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_manifest(folder: Path, edit) -> None:
    m = json.loads((folder / MANIFEST_NAME).read_text())
    edit(m)
    (folder / MANIFEST_NAME).write_text(json.dumps(m))


def _point_files_outside(folder: Path) -> None:
    """A checksummed 'files' entry that climbs out to a real file (so the checksum matches)."""
    secret = folder.parent / "secret.txt"
    secret.write_text("not yours")
    rel = "../" * len(folder.parts) + str(secret).lstrip("/")
    edit_manifest(folder, lambda m: m["files"].update({rel: file_digest(secret)}))


def _graph_outside(folder: Path) -> None:
    """graph.file '../x/model.onnx', listed with its checksum: quantize used to write ../x/ next to -o."""
    (folder.parent / "x").mkdir()
    shutil.move(folder / "model.onnx", folder.parent / "x" / "model.onnx")

    def edit(m):
        d = m["files"].pop("model.onnx")
        m["files"]["../x/model.onnx"] = d
        m["graph"].update(file="../x/model.onnx", files=["../x/model.onnx"])

    edit_manifest(folder, edit)


def _symlink_out(name: str):
    def make(folder: Path) -> None:
        outside = folder.parent / f"outside-{name}"
        shutil.move(folder / name, outside)  # same bytes, so the checksum still matches
        (folder / name).symlink_to(outside)

    return make


def _manifest_edit(fn):
    return lambda folder: edit_manifest(folder, fn)


BAD_FOLDERS = {
    "files entry ../../etc": _point_files_outside,
    "graph.file ../x": _graph_outside,
    "graph symlinked out": _symlink_out("model.onnx"),
    "tokenizer symlinked out": _symlink_out("tokenizer.json"),
    "generation config symlinked out": _symlink_out("generation_config.json"),
    "absolute tokenizer": _manifest_edit(lambda m: m.update(tokenizer="/etc/passwd")),
    "tokenizer not listed": _manifest_edit(lambda m: m["files"].pop("tokenizer.json")),
    "NUL in a file name": _manifest_edit(lambda m: m["files"].update({"a\x00b": m["files"]["config.json"]})),
    "non-string graph file": _manifest_edit(lambda m: m["graph"].update(files=["model.onnx", 5])),
    "non-string tokenizer": _manifest_edit(lambda m: m.update(tokenizer=["tokenizer.json"])),
    "malformed checksum": _manifest_edit(lambda m: m["files"].update({"config.json": "abc"})),
    "non-integer dims": _manifest_edit(lambda m: m["dims"].update(n_layer="2")),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
@pytest.mark.parametrize("verify", [True, False])
def test_paths_outside_the_folder_are_refused(tiny_export, tmp_path, case, verify):
    bad = copy_export(tiny_export, tmp_path / "m")
    BAD_FOLDERS[case](bad)
    with pytest.raises(ModelFolderError):
        ModelFolder.open(bad, verify=verify)
    with pytest.raises(ModelFolderError):
        Generator(bad, verify=verify)


@pytest.mark.parametrize("case", ["files entry ../../etc", "graph.file ../x", "graph symlinked out"])
def test_quantize_reads_and_writes_only_inside_the_folders(tiny_export, tmp_path, case):
    bad = copy_export(tiny_export, tmp_path / "m")
    BAD_FOLDERS[case](bad)
    before = sorted(p.name for p in tmp_path.iterdir())
    r = cli("quantize", bad, "-o", tmp_path / "q", "--mode", "int8", "--no-report")
    assert_one_line_error(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if (tmp_path / "x").exists():
        assert [p.name for p in (tmp_path / "x").iterdir()] == ["model.onnx"]  # nothing written beside it


@pytest.mark.parametrize("name", ["tokenizer.json", "model.onnx", "generation_config.json"])
def test_no_verify_still_checks_every_loaded_file_exists(tiny_export, tmp_path, name):
    bad = copy_export(tiny_export, tmp_path / "m")
    (bad / name).unlink()
    with pytest.raises(ModelFolderError, match=name):
        Generator(bad, verify=False)
    r = cli("generate", bad, "--no-verify", "-p", "hi", "-n", "2")
    assert_one_line_error(r, name)


def test_manifest_is_typed_and_frozen(tiny_export):
    f = ModelFolder.open(tiny_export)
    m = dict(load_manifest(tiny_export).raw)
    assert f.dims.n_layer == f.dims["n_layer"] == m["dims"]["n_layer"] == 2
    assert f.dims.head_dim == m["dims"]["n_embd"] // m["dims"]["n_head"]
    assert f.graph.file == "model.onnx" and f.graph.files == ("model.onnx",)
    assert (f.head, f.kv_cache, f.precision) == ("last", "concat", "fp32")
    assert f.info.files["model.onnx"].size == f.model_bytes() == (tiny_export / "model.onnx").stat().st_size
    assert f.manifest == m
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.dims.n_layer = 3  # type: ignore[misc]
    with pytest.raises(KeyError):
        f.dims["no_such_dim"]


def test_manifest_write_is_atomic(tiny_export, tmp_path, monkeypatch):
    from gpt2edge import manifest as manifest_mod

    folder = copy_export(tiny_export, tmp_path / "m")
    before = (folder / MANIFEST_NAME).read_text()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manifest_mod.os, "fsync", no_space)
    with pytest.raises(OSError):
        manifest_mod.write_manifest(folder, json.loads(before))
    assert (folder / MANIFEST_NAME).read_text() == before
    assert hidden(folder) == []


# --- 8. temp folders of killed runs are removed by the next write into the same parent ---------------------


KILLED = """
import os, signal, sys, time
from pathlib import Path
from types import SimpleNamespace
from gpt2edge.folder import atomic_output_dir
with atomic_output_dir(Path(sys.argv[1])) as tmp:
    (tmp / "model.onnx").write_bytes(b"half")
    print(tmp.name, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
"""


def run_writer(out: Path, mode: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED), str(out), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    return p, p.stdout.readline().strip()


def test_stale_temp_folders_are_cleaned_live_ones_kept(tiny_export, tmp_path):
    killed, killed_tmp = run_writer(tmp_path / "a", "kill")
    killed.wait()
    assert killed.returncode == -signal.SIGKILL and (tmp_path / killed_tmp).is_dir()
    live, live_tmp = run_writer(tmp_path / "b", "sleep")
    try:
        # a dead writer's pid reused by a live process (this one): its start time differs, so it is stale too
        pid = str(killed.pid)
        reused = killed_tmp.replace(f"-{pid}-", f"-{os.getpid()}-")
        (tmp_path / reused).mkdir()
        # not ours to judge: another machine's temp folder, and a hidden folder of another tool
        other_host = tmp_path / (killed_tmp.split(".tmp-")[0] + ".tmp-00000000-" + killed_tmp.split("-", 2)[2])
        other_host.mkdir()
        (tmp_path / ".a.tmp-user").mkdir()

        quick_quantize(tiny_export, tmp_path / "q")

        left = hidden(tmp_path)
        assert killed_tmp not in left and reused not in left
        assert live_tmp in left and other_host.name in left and ".a.tmp-user" in left
        assert (tmp_path / live_tmp / "model.onnx").read_bytes() == b"half"  # a live writer's work is untouched
    finally:
        live.kill()
        live.wait()
    assert live.returncode == -signal.SIGKILL


# --- 12. one clear line, nothing half-written ------------------------------------------------------------


def test_read_only_parent(tiny_checkpoint, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkdir = os.mkdir

    def read_only_mkdir(path, *a, **k):
        if Path(path).is_relative_to(ro):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", read_only_mkdir)
    for out in (ro / "out", ro / "deeper" / "out"):
        r = cli("export", "-m", tiny_checkpoint, out, "--no-validate")
        assert_one_line_error(r, "read-only file system")
    assert list(ro.iterdir()) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_parent_by_permissions(tiny_checkpoint, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    try:
        r = cli("export", "-m", tiny_checkpoint, ro / "out", "--no-validate")
        assert_one_line_error(r, "permission denied")
    finally:
        ro.chmod(0o755)


def test_parent_is_a_file(tiny_checkpoint, tmp_path):
    (tmp_path / "f").write_text("x")
    r = cli("export", "-m", tiny_checkpoint, tmp_path / "f" / "out", "--no-validate")
    assert_one_line_error(r, "not a folder")


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _half_write_then_enospc(model, path, **k):
    Path(path).write_bytes(b"\0" * 1000)
    _enospc()


@pytest.mark.parametrize("where", ["graph", "manifest", "wrapped"])
def test_disk_full_during_export(tiny_checkpoint, tmp_path, monkeypatch, where):
    from gpt2edge import manifest as manifest_mod

    if where == "graph":
        monkeypatch.setattr(onnx_graph, "export_graph", _half_write_then_enospc)
    elif where == "manifest":
        monkeypatch.setattr(manifest_mod.os, "fsync", _enospc)
    else:  # a C++ writer reports ENOSPC as its own exception: the free space tells
        monkeypatch.setattr(onnx_graph, "export_graph", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("write")))
        monkeypatch.setattr(folder_mod.shutil, "disk_usage", lambda p: SimpleNamespace(total=1, used=1, free=0))
    r = cli("export", "-m", tiny_checkpoint, tmp_path / "out", "--no-validate")
    assert_one_line_error(r, "disk full")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_during_quantize(tiny_export, tmp_path, monkeypatch):
    from gpt2edge.quantize import graph

    monkeypatch.setattr(graph, "save_model", _half_write_then_enospc)
    r = cli("quantize", tiny_export, "-o", tmp_path / "q", "--mode", "int8", "--no-report")
    assert_one_line_error(r, "disk full")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", [".", "..", "cwd", "./"])
def test_out_is_the_current_folder_or_holds_it(tiny_checkpoint, tiny_export, tmp_path, monkeypatch, out):
    work = copy_export(tiny_export, tmp_path / "work")  # a gpt2edge folder: --force alone would allow it
    monkeypatch.chdir(work)
    out = str(work) if out == "cwd" else out
    before = snapshot(tmp_path)
    quantize = ["quantize", tiny_export, "-o", out, "--mode", "int8", "--no-report"]
    for args in (["export", "-m", tiny_checkpoint, out, "--no-validate"], quantize):
        r = cli(*args, "--force")
        assert_one_line_error(r, "current folder")
    assert snapshot(tmp_path) == before
