"""A damaged folder's error names only fixes that exist where it was raised: the library's message names no CLI
flag, and a command adds "--no-verify" to a checksum error only when it has that option (generate, score,
serve). Every command that loads a folder is run on a folder whose graph was truncated."""

from __future__ import annotations

import re
import shutil

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.errors import ChecksumError, ModelFolderError
from gpt2edge.manifest import verify_files
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.folder import ModelFolder

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMANDS = ["generate", "bench", "parity", "score", "quantize", "convert", "trim-vocab", "sparse-head", "serve"]


@pytest.fixture(scope="module")
def damaged(tiny_export, tmp_path_factory):
    """A copy of the tiny export whose graph lost its second half (the manifest still lists the whole file)."""
    out = tmp_path_factory.mktemp("damaged") / "model"
    shutil.copytree(tiny_export, out)
    graph = out / "model.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    return out


def runs(good, bad, tmp):
    """command -> argument lists that load the damaged folder (as the model, or as the other folder it reads)."""
    ids = tmp / "ids.txt"
    ids.write_text(" ".join(map(str, range(300))))
    return {
        "generate": [["generate", bad, "-p", "x", "-n", "2"]],
        "bench": [["bench", bad, "--prompt-len", "4", "--new-tokens", "2", "--repeat", "1"]],
        "parity": [["parity", bad, good], ["parity", good, bad]],
        "score": [["score", bad, "-"]],
        "quantize": [["quantize", bad, "-o", tmp / "q", "--mode", "int8", "--no-report"]],
        "convert": [["convert", bad, "-o", tmp / "c", "--format", "ort"]],
        "trim-vocab": [["trim-vocab", bad, "-o", tmp / "t", "--keep-ids", ids, "--no-report"]],
        "sparse-head": [["sparse-head", bad, "-o", tmp / "s"]],
        "serve": [["serve", bad, "--port", "0"]],
    }


def test_every_command_that_loads_a_folder_is_covered(tiny_export, tmp_path):
    loads = {name for name, cmd in main.commands.items() if any(p.name == "model_dir" for p in cmd.params)}
    assert loads <= set(COMMANDS) == set(runs(tiny_export, tiny_export, tmp_path)), loads


def option_names(command: str) -> set[str]:
    return {o for p in main.commands[command].params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def named_fixes(command: str, line: str) -> set[str]:
    """Flags a message may name: the command's own, and those of a command it names ("export ... --head tail")."""
    others = [c for c in main.commands if c != command and re.search(rf"\b{c}\b", line)]
    return option_names(command).union(*map(option_names, others))


@pytest.mark.parametrize("command", COMMANDS)
def test_a_damaged_folder_error_names_only_flags_the_command_has(tiny_export, damaged, tmp_path, command, monkeypatch):
    if command == "serve":
        pytest.importorskip("fastapi")
        import gpt2edge.serve.hosting.server as server

        def started(*args, **kwargs):
            raise AssertionError("the server started on a damaged folder")

        monkeypatch.setattr(server, "serve_forever", started)
    for args in runs(tiny_export, damaged, tmp_path)[command]:
        out = CliRunner().invoke(main, list(map(str, args)), input="hello world, hello river")
        assert out.exit_code == 1, out.output
        assert "Traceback" not in out.output
        line = out.stderr.strip().splitlines()[-1]
        assert line.startswith("error: "), out.stderr
        named = set(FLAG.findall(line))
        assert named <= named_fixes(command, line), f"{command} has no {named - named_fixes(command, line)}: {line}"
        if "checksum" in line and "--no-verify" in option_names(command):
            assert "--no-verify" in line, line  # where the flag exists, the way around the check is named
        assert not [p for p in tmp_path.iterdir() if p.name != "ids.txt"], "a failed command left output behind"


def test_the_library_message_names_no_cli_flag(damaged):
    with pytest.raises(ChecksumError) as e:
        Generator(damaged)
    assert "model.onnx" in str(e.value) and "re-export" in str(e.value)
    assert not FLAG.search(str(e.value)), str(e.value)
    with pytest.raises(ChecksumError):
        verify_files(damaged, ModelFolder.open(damaged, verify=False).info)
    with pytest.raises(ModelFolderError) as e:  # ONNX Runtime refuses the truncated graph: no flag named either
        Generator(damaged, verify=False)
    assert not FLAG.search(str(e.value)), str(e.value)


def test_generate_with_no_verify_reaches_the_graph(damaged):
    """The fix the hint names works: --no-verify skips the checksum, and ONNX Runtime then names the file."""
    out = CliRunner().invoke(main, ["generate", str(damaged), "-p", "x", "-n", "2", "--no-verify"])
    assert out.exit_code == 1 and "checksum" not in out.stderr and "cannot load" in out.stderr, out.output
