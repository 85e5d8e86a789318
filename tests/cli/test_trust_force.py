"""--force never deletes an input: every path option of every command, found by walking the click commands.

An input (model folder, text, id list, corpus, draft, tokenizer, ...) that is the output or lies inside it is
refused with one `error:` line, with --force too, and is still there afterwards. A new option is covered as soon
as it is typed click.Path (and a string option that names a file or folder in its help must be).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.cli.paths import OutputPath
from gpt2edge.manifest.records import FORMAT, MANIFEST_NAME

# string options whose help names a file or folder without taking a path
# --json-schema takes a schema's text or a file (read bounded, before the model: cli/generate.constraint_of)
NOT_PATHS = {("serve", "model_name"), ("generate", "json_schema")}


def _is_path(p: click.Parameter) -> bool:
    return isinstance(p.type, (click.Path, click.File))


def _cells() -> list[tuple[str, str, str, str]]:
    """(command, output param, input param, "file"/"folder") for every input path option of every command that
    writes something."""
    cells = []
    for name, cmd in sorted(main.commands.items()):
        outs = [p for p in cmd.params if isinstance(p.type, OutputPath)]
        for out in outs:
            for p in cmd.params:
                if p is out or not _is_path(p) or isinstance(p.type, OutputPath):
                    continue
                kinds = []
                if getattr(p.type, "file_okay", True):
                    kinds.append("file")
                if getattr(p.type, "dir_okay", False) and out.type.dir_okay:
                    kinds.append("folder")
                cells += [(name, out.name, p.name, k) for k in kinds]
    return cells


CELLS = _cells()


def test_grid_covers_the_known_writers():
    """The walk finds every command that writes, and the options the issue names."""
    found = {(c, i) for c, _, i, _ in CELLS}
    for cell in [
        ("trim-vocab", "keep_ids"),
        ("trim-vocab", "keep_from"),
        ("trim-vocab", "text_file"),
        ("trim-vocab", "model_dir"),
        ("quantize", "text_file"),
        ("quantize", "model_dir"),
        ("convert", "model_dir"),
        ("export", "source"),
        ("export", "tokenizer"),
        ("random-checkpoint", "tokenizer"),
        ("bench", "texts"),
        ("bench", "draft"),
    ]:
        assert cell in found, cell


def test_string_options_that_name_paths_are_typed_paths():
    """A new path option given as a plain string would escape the guard: the help text gives it away."""
    for name, cmd in main.commands.items():
        for p in cmd.params:
            help_text = getattr(p, "help", None) or ""
            if type(p.type) is not click.types.StringParamType or (name, p.name) in NOT_PATHS:
                continue
            assert not re.search(r"\b(file|folder|directory|path)s?\b", help_text, re.I), (name, p.name, help_text)


def _dummy(p: click.Parameter, tmp: Path):
    """A value click accepts for a required parameter that the cell does not test."""
    if _is_path(p):
        f = tmp / "elsewhere" / f"{p.name}.txt"
        f.parent.mkdir(exist_ok=True)
        f.write_text("hello world\n")
        return str(f)
    if isinstance(p.type, click.Choice):
        return p.type.choices[0]
    return "1"


def _args(cmd: click.Command, values: dict[str, list[str]], tmp: Path) -> list[str]:
    args, positional = [], []
    for p in cmd.params:
        vals = values.get(p.name)
        if vals is None and p.required:
            vals = [_dummy(p, tmp)]
        for v in vals or []:
            if isinstance(p, click.Argument):
                positional.append(v)
            else:
                args += [max(p.opts, key=len), v]
    if any(p.name == "force" for p in cmd.params):
        args.append("--force")
    return [*args, "--", *positional]


def _existing_output(out: Path, is_dir: bool) -> None:
    """What --force may replace: a gpt2edge folder that is also a checkpoint folder (random-checkpoint's kind)."""
    if not is_dir:
        out.write_bytes(b"old")
        return
    out.mkdir()
    (out / MANIFEST_NAME).write_text(json.dumps({"format": FORMAT}))
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"x")


@pytest.mark.parametrize(("command", "out_param", "in_param", "kind"), CELLS, ids=lambda v: str(v))
def test_input_inside_output_is_refused_with_force(tmp_path, command, out_param, in_param, kind):
    cmd = main.commands[command]
    out_type = next(p for p in cmd.params if p.name == out_param).type
    out = tmp_path / "old"
    _existing_output(out, out_type.dir_okay)
    if out_type.dir_okay:  # the input lies inside OUT
        target = out / "data"
        if kind == "folder":
            target.mkdir()
            (target / "corpus.txt").write_text("keep me\n")
        else:
            target.write_text("50256\n")
    else:  # a file output: the input is that very file
        target = out
    cli_args = _args(cmd, {out_param: [str(out)], in_param: [str(target)]}, tmp_path)
    result = CliRunner().invoke(main, [command, *cli_args])
    assert result.exit_code == 1, (cli_args, result.output)
    assert re.search(r"^error: .*(lies inside the output folder|is the input (file|folder) \()", result.output, re.M), (
        result.output
    )
    assert "Traceback" not in result.output
    assert target.exists() and (out / MANIFEST_NAME).exists() == out_type.dir_okay


@pytest.mark.parametrize("command", sorted({c for c, o, _, _ in CELLS if o == "out"}))
def test_input_that_is_the_output_folder_is_refused(tmp_path, command):
    """OUT itself given as a folder input (a tokenizer, corpus or model folder): refused, left as it was."""
    cmd = main.commands[command]
    folder_inputs = [
        p.name
        for p in cmd.params
        if _is_path(p) and not isinstance(p.type, OutputPath) and getattr(p.type, "dir_okay", False)
    ]
    out = tmp_path / "old"
    _existing_output(out, True)
    for name in folder_inputs:
        result = CliRunner().invoke(main, [command, *_args(cmd, {"out": [str(out)], name: [str(out)]}, tmp_path)])
        assert result.exit_code == 1 and "error:" in result.output, (name, result.output)
        assert (out / MANIFEST_NAME).exists()


def test_trim_keep_ids_inside_output_survives_end_to_end(tiny_export, tmp_path):
    """The issue's case on a real folder: trim-vocab -o old --keep-ids old/ids.txt --force kept deleting ids.txt."""
    from gpt2edge.trim.handler import trim_vocab

    out = tmp_path / "old"
    trim_vocab(tiny_export, out, keep_ids=None, keep_from=[_corpus(tmp_path)], report=False)
    ids = out / "ids.txt"
    ids.write_text(" ".join(str(i) for i in range(300)) + "\n")
    result = CliRunner().invoke(
        main, ["trim-vocab", str(tiny_export), "-o", str(out), "--keep-ids", str(ids), "--force"]
    )
    assert result.exit_code == 1 and "lies inside the output folder" in result.output, result.output
    assert ids.read_text().startswith("0 1 2")
    # the library refuses it too (a Python caller has no CLI guard)
    from gpt2edge.errors import OutputFolderError

    with pytest.raises(OutputFolderError, match="inside the output"):
        trim_vocab(tiny_export, out, keep_ids=ids, force=True, report=False)
    with pytest.raises(OutputFolderError, match="inside the output"):
        trim_vocab(tiny_export, out, keep_from=[out / "ids.txt"], force=True, report=False)
    with pytest.raises(OutputFolderError, match="output folder is the input folder"):
        trim_vocab(tiny_export, out, keep_from=[out], force=True, report=False)
    assert ids.exists()


def _corpus(tmp_path: Path) -> Path:
    c = tmp_path / "corpus.txt"
    c.write_text("the quick brown fox jumps over the lazy dog\n" * 3)
    return c
