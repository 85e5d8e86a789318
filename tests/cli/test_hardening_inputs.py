"""Hostile folders and inputs (issue 10): a damaged graph or tokenizer under --no-verify, a manifest or
generation_config.json that disagrees with the graph, JSON nested too deep, binary --text files, an allocation
that fails, a trimmed folder converted for genai. Each is one `error:` line and exit 1, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.convert.handler import convert_folder
from gpt2edge.errors import ConvertError, ModelFolderError
from gpt2edge.manifest import MANIFEST_NAME
from gpt2edge.prompt_input import parse_prompts
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.kv_cache import KVCache
from tests.support import cli

REPO = Path(__file__).resolve().parents[2]
DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that Python's parser cannot nest this deep


def assert_one_line_error(result, *phrases):
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: "), result.output
    for phrase in phrases:
        assert phrase.lower() in line.lower(), line


@pytest.fixture
def copy(tiny_export, tmp_path):
    """A fresh copy of the tiny export to damage."""
    out = tmp_path / "model"
    shutil.copytree(tiny_export, out)
    return out


def edit_manifest(folder: Path, edit) -> None:
    path = folder / MANIFEST_NAME
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


# --- damaged files under --no-verify reach ONNX Runtime and tokenizers: their errors become one line ----------


@pytest.mark.parametrize(
    "damage",
    {
        "truncated": lambda b: b[:1000],
        "empty": lambda b: b"",
        "garbage": lambda b: os.urandom(5000),
    }.items(),
    ids=lambda d: d[0],
)
def test_damaged_graph_with_no_verify_is_one_line(copy, damage):
    graph = copy / "model.onnx"
    graph.write_bytes(damage[1](graph.read_bytes()))
    assert_one_line_error(cli("generate", copy, "-p", "hi", "-n", "2", "--no-verify"), "cannot load", "model.onnx")
    with pytest.raises(ModelFolderError, match="ONNX Runtime cannot load"):
        Generator(copy, verify=False)


@pytest.mark.parametrize(
    "content",
    [b'{"version": "1.0", "trunc', b"", b"\xff\xfe\x00garbage", b'{"a": 1}'],
    ids=["truncated", "empty", "binary", "not-a-tokenizer"],
)
def test_damaged_tokenizer_with_no_verify_is_one_line(copy, content):
    (copy / "tokenizer.json").write_bytes(content)
    assert_one_line_error(cli("generate", copy, "-p", "hi", "--no-verify"), "tokenizer.json")
    assert_one_line_error(cli("score", copy, "--no-verify", "-"), "tokenizer.json")


# --- a manifest whose dims disagree with the graph is refused before a cache is sized from it --------------


@pytest.mark.parametrize(
    "key, value, phrase",
    [
        ("n_layer", 3, "n_layer 3"),
        ("n_layer", 10**20, "n_layer"),  # once a numpy allocation error
        ("head_dim", 7, "head_dim 7"),
        ("n_head", 2, "n_head 2"),
    ],
)
def test_manifest_dims_that_disagree_with_the_graph(copy, key, value, phrase):
    edit_manifest(copy, lambda m: m["dims"].__setitem__(key, value))
    with pytest.raises(ModelFolderError, match="does not match its manifest|manifest says") as e:
        Generator(copy)
    assert phrase in str(e.value)
    assert_one_line_error(cli("generate", copy, "-p", "hi", "-n", "2"), phrase)


def test_manifest_kv_dtype_that_disagrees_with_the_graph(copy):
    edit_manifest(copy, lambda m: m["graph"].__setitem__("kv_dtype", "float16"))
    with pytest.raises(ModelFolderError, match="kv_dtype float16"):
        Generator(copy)


def test_graph_failure_mid_generation_is_one_line_without_ort_log(copy):
    """n_positions above the graph's position table: the check of -n passes, ONNX Runtime refuses position
    128. Run as the console script does, so ONNX Runtime's own log (written to fd 2) would be seen."""
    edit_manifest(copy, lambda m: m["dims"].__setitem__("n_positions", 4096))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (["generate", str(copy), "-p", "hi", "-n", "200"], ["score", str(copy), "-"]):
        r = subprocess.run(
            [sys.executable, "-m", "gpt2edge.cli", *args],
            input="hello " * 300,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ONNX Runtime failed running"), r.stderr
        assert "n_positions" in lines[0]


# --- generation_config.json: the values the user never typed are checked, and the error names the file -----


@pytest.mark.parametrize(
    "config, phrase",
    [
        ({"eos_token_id": [1, "a"]}, "eos_token_id"),  # once a TypeError traceback
        ({"bos_token_id": "x"}, "bos_token_id"),  # once a ValueError traceback
        ({"bos_token_id": 99999}, "bos_token_id"),  # once an ONNX Runtime Gather traceback (empty prompt)
        ({"pad_token_id": -5}, "pad_token_id"),
        ({"eos_token_id": 1.5}, "eos_token_id"),  # once silently truncated to 1
        ({"temperature": "hot", "do_sample": True}, "temperature"),
        ({"top_k": -3}, "top_k"),
    ],
)
def test_generation_config_values_are_checked(copy, config, phrase):
    (copy / "generation_config.json").write_text(json.dumps(config))
    result = cli("generate", copy, "-p", "", "-n", "2", "--no-verify")
    assert_one_line_error(result, "generation_config.json", phrase)
    with pytest.raises(ModelFolderError, match="generation_config.json"):
        Generator(copy, verify=False)


# --- JSON nested too deep is bad JSON, not a RecursionError ------------------------------------------------


def test_deeply_nested_manifest_and_generation_config(copy, tiny_export, tmp_path):
    (copy / "generation_config.json").write_text(DEEP)
    assert_one_line_error(cli("generate", copy, "-p", "hi", "--no-verify"), "generation_config.json")
    (copy / MANIFEST_NAME).write_text(DEEP)
    assert_one_line_error(cli("generate", copy, "-p", "hi"), "not valid JSON")
    # --force asks whether OUT is a gpt2edge folder: one with a deep manifest is simply not one
    other = tmp_path / "other"
    other.mkdir()
    (other / MANIFEST_NAME).write_text(DEEP)
    assert_one_line_error(cli("convert", tiny_export, "-o", other, "--format", "ort", "--force"), "not a gpt2edge")
    assert_one_line_error(cli("random-checkpoint", other, "--force"), "not empty")


def test_deeply_nested_keep_ids_prompt_line_and_checkpoint_config(tiny_export, tmp_path):
    keep = tmp_path / "keep.json"
    keep.write_text(DEEP)
    result = cli("trim-vocab", tiny_export, "-o", tmp_path / "t", "--keep-ids", keep, "--no-report")
    assert_one_line_error(result, "JSON array")
    assert parse_prompts(DEEP + "\n", "auto", "f") == [DEEP]  # not a prompt object: the line is the prompt
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(DEEP)
    assert_one_line_error(cli("export", "-m", ckpt, tmp_path / "e"), "config.json")
    (ckpt / "config.json").write_bytes(b"\xff\xfe binary")  # a UnicodeDecodeError, not a JSONDecodeError
    assert_one_line_error(cli("export", "-m", ckpt, tmp_path / "e"), "config.json")
    (ckpt / "config.json").write_text("[1, 2]")  # once AttributeError: 'list' object has no attribute 'get'
    assert_one_line_error(cli("export", "-m", ckpt, tmp_path / "e"), "config.json")


def test_deeply_nested_serve_request_is_a_400():
    pytest.importorskip("pydantic")
    from gpt2edge.serve.api.protocol import ApiError, parse_request

    with pytest.raises(ApiError) as e:
        parse_request(DEEP.encode())
    assert e.value.status == 400


# --- --text files are read as UTF-8 with one clear error --------------------------------------------------


@pytest.mark.parametrize("command", ["quantize", "parity", "trim-vocab"])
def test_binary_text_option_is_one_line(tiny_export, tmp_path, command):
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xc6\xff\x00 not text")
    args = {
        "quantize": ["quantize", tiny_export, "-o", tmp_path / "q", "--mode", "int8"],
        "parity": ["parity", tiny_export, tiny_export],
        "trim-vocab": ["trim-vocab", tiny_export, "-o", tmp_path / "t", "--keep-ids", tmp_path / "ids.txt"],
    }[command]
    (tmp_path / "ids.txt").write_text("0 1 2 3")
    assert_one_line_error(cli(*args, "--text", binary), "bin.txt", "UTF-8")
    assert not [p for p in tmp_path.iterdir() if p.name not in ("bin.txt", "ids.txt")]


# --- an allocation that fails (10^7 beams or samples) is one line ------------------------------------------


def test_memory_error_is_one_line(tiny_export, monkeypatch):
    def no_memory(self, batch, length):
        raise MemoryError(f"Unable to allocate the cache of {batch} rows")

    monkeypatch.setattr(KVCache, "reserve", no_memory)
    result = cli("generate", tiny_export, "-p", "hi", "--num-return-sequences", "3", "--do-sample", "-n", "4")
    assert_one_line_error(result, "out of memory", "fewer prompts, beams or samples")


# --- progress bars on a terminal only (CliRunner's stderr is not one) ---------------------------------------


def test_no_progress_bar_off_a_terminal(tiny_export, tmp_path):
    result = CliRunner().invoke(main, ["random-checkpoint", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    assert "%|" not in result.output and "it/s" not in result.output, result.output
    ids = tmp_path / "ids.txt"
    ids.write_text("0 1 2 3")
    result = cli("trim-vocab", tiny_export, "-o", tmp_path / "t", "--keep-ids", ids, "--no-report")
    assert result.exit_code == 0, result.output
    assert "%|" not in result.output and "step/s" not in result.output, result.output


# --- genai has no kept-id map: a trimmed folder would generate wrong ids silently --------------------------


def test_convert_genai_refuses_a_trimmed_folder(tiny_export, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(map(str, range(300))))  # id 0 is the tiny tokenizer's EOS
    trimmed = tmp_path / "trimmed"
    cli_result = cli("trim-vocab", tiny_export, "-o", trimmed, "--keep-ids", ids, "--no-report")
    assert cli_result.exit_code == 0, cli_result.output
    with pytest.raises(ConvertError, match="vocabulary-trimmed"):
        convert_folder(trimmed, tmp_path / "g", "genai")
    assert not (tmp_path / "g").exists()
    assert convert_folder(trimmed, tmp_path / "o", "ort")["vocab"]["kept"] == 300  # the runtime maps ids back
