"""Hostile manifest.json files (and keep-lists) get one short `error:` line and exit status 1 from every command
that reads them: never a traceback, never a line that repeats megabytes of the file, never a silent choice
between two values of one key."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.errors import ModelFolderError
from gpt2edge.manifest import MANIFEST_NAME, load_manifest

HUGE_INT = "9" * 5000  # past Python's 4300-digit limit for int(str): json.loads raises ValueError, not JSONDecodeError


def hostile(tiny_export, tmp_path, edit) -> str:
    """A copy of the tiny export whose manifest.json text is edit(text)."""
    out = tmp_path / "m"
    shutil.copytree(tiny_export, out)
    path = out / MANIFEST_NAME
    path.write_text(edit(path.read_text()))
    return str(out)


def refused_in_one_line(result, *phrases: str) -> str:
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output[:2000]
    assert len(lines[0]) < 400, f"{len(lines[0])} characters: {lines[0][:200]}..."
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def insert(key_json: str):
    """An edit that puts `"key": value, ` right after the manifest's opening brace."""
    return lambda text: "{" + key_json + ", " + text.lstrip()[1:]


def long_key(text: str) -> str:
    data = json.loads(text)
    data["files"]["x" * 300] = {"sha256": "0" * 64, "size": 1}  # a name the OS refuses (ENAMETOOLONG)
    return json.dumps(data)


def long_tokenizer(text: str) -> str:
    return json.dumps({**json.loads(text), "tokenizer": "t/" * 50_000 + "tokenizer.json"})


def dims_key_twice(text: str) -> str:
    return text.replace('"dims": {', '"dims": {"n_layer": 7, ', 1)


CASES = {
    "an integer of 5000 digits": (insert(f'"quality": {{"x": {HUGE_INT}}}'), ["not valid JSON"]),
    "a listed file whose name the OS refuses": (long_key, ["cannot be read", "re-export"]),
    "a 100 kB path": (long_tokenizer, ["t/t/t/", "...", "is loaded but not listed"]),
    "a key given twice": (dims_key_twice, ["n_layer", "twice"]),
    "a top-level key given twice": (insert('"format": "gpt2edge-export"'), ["format", "twice"]),
}

COMMANDS = {
    "generate": ["generate", "{dir}", "-p", "a", "-n", "1"],
    "score": ["score", "{dir}", "-"],
    "quantize": ["quantize", "{dir}", "-o", "{out}", "--mode", "int8", "--no-report"],
    "convert": ["convert", "{dir}", "-o", "{out}", "--format", "ort"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_manifest_is_one_error_line(tiny_export, tmp_path, case, command):
    edit, phrases = CASES[case]
    folder = hostile(tiny_export, tmp_path, edit)
    args = [a.format(dir=folder, out=tmp_path / "out") for a in COMMANDS[command]]
    refused_in_one_line(CliRunner().invoke(main, args, input="some text to score"), *phrases)
    assert not (tmp_path / "out").exists()


def test_the_library_raises_model_folder_error(tiny_export, tmp_path):
    for edit, _ in CASES.values():
        shutil.rmtree(tmp_path / "m", ignore_errors=True)
        folder = hostile(tiny_export, tmp_path, edit)
        with pytest.raises(ModelFolderError):
            from gpt2edge.manifest import verify_files

            verify_files(folder, load_manifest(folder))


def test_keep_ids_with_an_integer_of_5000_digits_is_one_error_line(tiny_export, tmp_path):
    keep = tmp_path / "keep.json"
    keep.write_text(f"[0, {HUGE_INT}]")
    args = ["trim-vocab", str(tiny_export), "-o", str(tmp_path / "out"), "--keep-ids", str(keep), "--no-report"]
    refused_in_one_line(CliRunner().invoke(main, args), "keep.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", [HUGE_INT, "1 2 ²", f"[1, {HUGE_INT}]"])
def test_keep_ids_that_are_not_ids_are_one_short_error_line(tiny_export, tmp_path, text):
    keep = tmp_path / "keep.txt"
    keep.write_text(text)
    args = ["trim-vocab", str(tiny_export), "-o", str(tmp_path / "out"), "--keep-ids", str(keep), "--no-report"]
    refused_in_one_line(CliRunner().invoke(main, args), "keep.txt")
    assert not (tmp_path / "out").exists()


def test_a_manifest_past_the_size_cap_is_refused_unread(tiny_export, tmp_path):
    """A manifest is a few kB; one of 16 MiB and more (a 10 GB sparse file would be read whole) is refused."""
    from gpt2edge.manifest.records import MAX_MANIFEST_BYTES

    folder = hostile(tiny_export, tmp_path, lambda text: text + " " * MAX_MANIFEST_BYTES)  # valid JSON, too big
    line = refused_in_one_line(CliRunner().invoke(main, ["generate", folder, "-p", "a", "-n", "1"]), "MB")
    assert "manifest.json" in line
    with open(tmp_path / "m" / MANIFEST_NAME, "r+b") as f:
        f.truncate(8 << 30)  # sparse: no disk used
    refused_in_one_line(CliRunner().invoke(main, ["generate", folder, "-p", "a", "-n", "1"]), "8192.0 MB")


def test_output_folder_checks_do_not_read_a_huge_manifest(tiny_export, tmp_path, monkeypatch):
    """`--force` asks whether OUT is an export folder: a huge manifest.json there is not one, and is not read."""
    import pathlib

    from gpt2edge.folder.checks import is_export_folder

    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    with open(out / MANIFEST_NAME, "r+b") as f:
        f.truncate(8 << 30)

    def unread(*a, **k):
        raise AssertionError("read a huge manifest")

    monkeypatch.setattr(pathlib.Path, "read_text", unread)
    monkeypatch.setattr(pathlib.Path, "read_bytes", unread)
    assert is_export_folder(out) is False


@pytest.mark.parametrize("source", [[1], "x", {"model": ["a"]}, {"model": "x" * 100_000}])
def test_export_of_an_export_folder_with_a_junk_source_is_one_error_line(tiny_export, tmp_path, source):
    """-m given an export folder is refused naming where it came from: a junk `source` record is no traceback."""
    folder = tmp_path / "exp"
    folder.mkdir()
    shutil.copy(tiny_export / "config.json", folder)
    (folder / MANIFEST_NAME).write_text(json.dumps({"format": "gpt2edge-export", "source": source}))
    out = tmp_path / "out"
    refused_in_one_line(CliRunner().invoke(main, ["export", "-m", str(folder), str(out)]), "already a gpt2edge export")
    assert not out.exists()


def junk_record(section: str, key: str, value):
    def edit(text: str) -> str:
        data = json.loads(text)
        data.setdefault(section, {})
        if section == "source":
            data[section][key] = value
        else:
            data[section]["parent"] = {key: value}
        return json.dumps(data)

    return edit


@pytest.mark.parametrize("section, key", [("source", "model"), ("source", "path"), ("quantization", "path")])
def test_a_100_kb_string_in_a_record_read_raw_is_named_at_load(tiny_export, tmp_path, section, key):
    """source and the parent records are read raw (bench --vs-torch loads source.model, refusals print the
    parent's path): a path longer than any the OS takes is refused at load, naming the field."""
    folder = hostile(tiny_export, tmp_path, junk_record(section, key, "p" * 100_000))
    field = f"{section}.{key}" if section == "source" else f"{section}.parent.{key}"
    refused_in_one_line(CliRunner().invoke(main, ["generate", folder, "-p", "a", "-n", "1"]), field, "4096")


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "{long}", "-p", "a"],
        ["quantize", "{model}", "-o", "{tmp}/{long}", "--mode", "int8"],
        ["export", "-m", "{long}", "{tmp}/out"],
        ["parity", "{model}", "-m", "{long}"],
    ],
)
def test_a_name_the_os_refuses_is_one_error_line(tiny_export, tmp_path, args):
    """A path component over the OS's 255 bytes (ENAMETOOLONG) in any argument: one short line, no traceback."""
    args = [a.format(long="p" * 300, model=tiny_export, tmp=tmp_path) for a in args]
    refused_in_one_line(CliRunner().invoke(main, args), "too long")
