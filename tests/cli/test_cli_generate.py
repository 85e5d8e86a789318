"""`gpt2edge generate` as a user meets it: true defaults in --help, an explicit sampling mode, prompts from
stdin and files, Ctrl-C, and bad input refused with one clear line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

import gpt2edge.runtime.decoding.generate as generate_loop
from gpt2edge.cli import main
from gpt2edge.runtime.model.tokenizer import StreamDecoder

GREEDY_ARGS = ("-p", "The river", "-n", "16", "--ignore-eos", "--json")


def gen(*args, input=None):
    return CliRunner().invoke(main, ["generate", *map(str, args)], input=input)


def token_ids(r) -> list[int]:
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["token_ids"]


def results(r) -> list[dict]:
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    return out["results"] if "results" in out else [out]


@pytest.fixture(scope="module")
def greedy(tiny_export) -> list[int]:
    return token_ids(gen(tiny_export, *GREEDY_ARGS))


# --- item 16: true defaults, explicit sampling mode ------------------------------------------------------


def option_help(text: str) -> dict[str, str]:
    """click's option table -> {each option name: its help, whitespace collapsed}."""
    out: dict[str, str] = {}
    names: list[str] = []
    for line in text.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if m:
            names = [w.strip(",") for w in m.group(1).split() if w.startswith("-")]
            for n in names:
                out[n] = m.group(2) or ""
        elif names and line.startswith("   "):
            for n in names:
                out[n] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in out.items()}


def test_help_shows_true_defaults(tiny_export):
    r = CliRunner().invoke(main, ["generate", "--help"])
    assert r.exit_code == 0
    helps = option_help(r.output)
    expected = {
        "--do-sample": "greedy",
        "-n": "32",
        "--min-new-tokens": "0",
        "--temperature": "1.0",
        "--top-k": "50",
        "--top-p": "1.0",
        "--repetition-penalty": "1.0",
    }
    for option, value in expected.items():
        assert f"[default: the model's generation_config.json, else {value}]" in helps[option], option
    assert "[default: 50]" not in " ".join(r.output.split())  # the old help, which sampling did not honour
    assert "notice" in helps["--do-sample"]  # what a knob without --do-sample does is documented


@pytest.mark.parametrize(
    "knob", [("--top-k", "50"), ("--temperature", "0.9"), ("--top-p", "0.5"), ("--seed", "3"), ("--top-k", "5")]
)
def test_sampling_knob_without_do_sample_stays_greedy_with_a_notice(tiny_export, greedy, knob):
    r = gen(tiny_export, *GREEDY_ARGS, *knob, "--seed", "0")
    assert token_ids(r) == greedy  # the mode did not change behind the user's back
    notice = [line for line in r.stderr.splitlines() if "sampling is off" in line]
    assert len(notice) == 1 and knob[0] in notice[0] and "--do-sample" in notice[0], r.stderr


def test_do_sample_samples_and_no_notice(tiny_export, greedy):
    runs = [gen(tiny_export, *GREEDY_ARGS, "--do-sample", "--top-k", "50", "--seed", "3") for _ in range(2)]
    assert token_ids(runs[0]) == token_ids(runs[1]) != greedy  # seeded sampling
    assert "sampling is off" not in runs[0].stderr
    plain = gen(tiny_export, *GREEDY_ARGS)
    assert "sampling is off" not in plain.stderr


def test_generation_config_sets_the_mode_and_flags_override_it(tiny_export, tmp_path, greedy):
    folder = tmp_path / "sampling-model"
    shutil.copytree(tiny_export, folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**cfg, "do_sample": True}))
    sampled = token_ids(gen(tiny_export, *GREEDY_ARGS, "--do-sample", "--seed", "3"))
    default = gen(folder, *GREEDY_ARGS, "--seed", "3", "--top-k", "50", "--no-verify")
    assert token_ids(default) == sampled and "sampling is off" not in default.stderr
    assert token_ids(gen(folder, *GREEDY_ARGS, "--greedy", "--no-verify")) == greedy


# --- item 18: prompts from stdin and files, --sequential, Ctrl-C ---------------------------------------------


def test_prompt_from_stdin(tiny_export, greedy):
    r = gen(tiny_export, *GREEDY_ARGS[2:], "-p", "-", input="The river\n")
    assert results(r)[0]["prompt"] == "The river" and token_ids(r) == greedy


@pytest.mark.parametrize(
    "content, fmt, prompts",
    [
        ("The river\n\n  \nVisitors came\n", "auto", ["The river", "Visitors came"]),
        ("The river\r\nVisitors came\r\n", "auto", ["The river", "Visitors came"]),  # Windows line ends
        ("\ufeffThe river\n", "auto", ["The river"]),  # a UTF-8 byte-order mark is not prompt text
        ('{"prompt": "The river"}\n\n{"prompt": "two\\nlines", "id": 7}\n', "auto", ["The river", "two\nlines"]),
        ('{"prompt": "The river"}\n', "lines", ['{"prompt": "The river"}']),  # --format lines: taken literally
        ('{"prompt": "The river"}\nplain text\n', "auto", ['{"prompt": "The river"}', "plain text"]),
        ('{"text": "no prompt field"}\n', "auto", ['{"text": "no prompt field"}']),
    ],
)
def test_prompt_file_formats(tiny_export, tmp_path, content, fmt, prompts):
    f = tmp_path / "prompts.txt"
    f.write_text(content, encoding="utf-8", newline="")
    r = gen(tiny_export, "--batch-file", f, "--format", fmt, "-n", "2", "--json")
    assert [x["prompt"] for x in results(r)] == prompts
    piped = gen(tiny_export, "--batch-file", "-", "--format", fmt, "-n", "2", "--json", input=content.encode())
    assert [x["prompt"] for x in results(piped)] == prompts  # --batch-file - reads the same from stdin


def test_prompt_file_is_one_batch_or_sequential(tiny_export, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("The river\nVisitors came to\n")
    single = [
        token_ids(gen(tiny_export, "-p", p, "-n", "8", "--ignore-eos", "--json")) for p in f.read_text().split("\n")[:2]
    ]
    for mode in ((), ("--sequential",)):
        r = gen(tiny_export, "--batch-file", f, "-n", "8", "--ignore-eos", "--json", *mode)
        assert [x["token_ids"] for x in results(r)] == single
    streamed = gen(tiny_export, "--batch-file", f, "-n", "8", "--ignore-eos", "--sequential")
    assert streamed.exit_code == 0, streamed.output
    lines = [line for line in streamed.stdout.splitlines() if not line.startswith("--- prompt ")]  # separators
    assert len(lines) == 2 and lines[0].startswith("The river") and lines[1].startswith("Visitors came to")
    assert sum("ms/token" in line for line in streamed.stderr.splitlines()) == 2  # a timing line per prompt


@pytest.mark.parametrize(
    "args, stdin, phrase",
    [
        ((), None, "No prompt given"),
        (("--batch-file", "EMPTY"), None, "holds no prompts"),
        (("--batch-file", "BLANK"), None, "holds no prompts"),
        (("--batch-file", "-"), "", "holds no prompts"),
        (("-f", "EMPTY"), None, "is empty"),
        (("-f", "-"), "\n", "is empty"),
        (("-p", "-"), "", "empty stdin"),
        (("-p", "-", "-f", "-"), "x\n", "stdin can be read once"),
        (("--batch-file", "JSONL", "--format", "jsonl"), None, 'line 3 is not a JSON object with a string "prompt"'),
    ],
)
def test_no_prompts_or_bad_files_are_clear_errors(tiny_export, tmp_path, args, stdin, phrase):
    files = {"EMPTY": "", "BLANK": "\n  \n\n", "JSONL": '{"prompt": "a"}\n\nplain\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [str(tmp_path / a) if a in files else a for a in args]
    r = gen(tiny_export, *args, input=stdin)
    assert r.exit_code == 1 and r.stdout == "", r.output
    assert r.stderr.startswith("error: ") and phrase in r.stderr and r.stderr.count("\n") == 1, r.stderr


def raise_after(fn, n: int):
    """fn, except that its n-th call raises KeyboardInterrupt (what Ctrl-C does at that moment)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize(
    "mode, where",
    [
        ("stream", "model"),  # Ctrl-C while ONNX Runtime runs a step (the library catches it)
        ("stream", "printing"),  # Ctrl-C while the CLI prints a piece (it reaches the CLI)
        ("batch", "model"),
        ("json", "model"),
        ("sequential", "model"),
        ("sequential-json", "model"),
    ],
)
def test_ctrl_c_exits_130_and_says_interrupted(tiny_export, monkeypatch, mode, where):
    if where == "model":
        monkeypatch.setattr(generate_loop, "decode_one_token", raise_after(generate_loop.decode_one_token, 4))
    else:
        monkeypatch.setattr(StreamDecoder, "push", raise_after(StreamDecoder.push, 4))
    args = {
        "stream": ("-p", "The river"),
        "batch": ("-p", "The river", "-p", "Visitors", "--no-stream"),
        "json": ("-p", "The river", "--json"),
        "sequential": ("-p", "The river", "-p", "Visitors", "--sequential"),
        "sequential-json": ("-p", "The river", "-p", "Visitors", "--sequential", "--json"),
    }[mode]
    r = gen(tiny_export, *args, "-n", "20", "--ignore-eos")
    assert r.exit_code == 130, r.output
    assert isinstance(r.exception, SystemExit)  # no traceback
    assert r.stderr.splitlines()[-1] == "[interrupted]"
    if mode == "json":
        assert json.loads(r.stdout)["finish_reason"] == "interrupted"  # stdout is still pure JSON
    elif mode == "sequential-json":  # two prompts: the batch shape, holding the one that was interrupted
        assert [x["finish_reason"] for x in json.loads(r.stdout)["results"]] == ["interrupted"]
    else:
        text = r.stdout.removeprefix("--- prompt 1/2 ---\n")  # several prompts: a separator line before each
        assert text.startswith("The river") and r.stdout.endswith("\n")
    if mode.startswith("sequential"):
        assert "Visitors" not in r.stdout  # stopped: the next prompt is not started


# --- item 12: bad input, one clear line, no traceback ------------------------------------------------------


def test_undecodable_argv_bytes_are_a_clear_error(tiny_export):
    """Linux hands undecodable argv bytes to Python as surrogate escapes; the tokenizer would crash on them."""
    cmd = [sys.executable, "-m", "gpt2edge.cli", "generate", str(tiny_export).encode(), b"-p", b"caf\xe9 au lait"]
    p = subprocess.run(cmd, capture_output=True, timeout=120)
    assert p.returncode == 1 and p.stdout == b"", p.stderr
    assert p.stderr.decode().splitlines() == [
        "error: The -p prompt is not valid UTF-8 (byte 0xe9 at character 3); pass UTF-8 text."
    ]


@pytest.mark.parametrize(
    "args, stdin, phrase",
    [
        (("-p", "\ud800 lone surrogate"), None, "lone surrogate U+D800"),
        (("-p", "ok", "-p", "bad \udcff"), None, "byte 0xff"),
        (("-p", "-"), b"caf\xe9\n", "stdin is not valid UTF-8 (byte 0xe9 on line 1)"),
        (("-f", "-"), b"good\n\xff\xfe bad\n", "stdin is not valid UTF-8 (byte 0xff on line 2)"),
        (("-f", "LATIN1"), None, "LATIN1 is not valid UTF-8 (byte 0xe9 on line 2)"),
        (("--batch-file", "JSONL"), None, "JSONL line 1 is not valid UTF-8 (lone surrogate U+D800"),
    ],
)
def test_text_that_is_not_utf8_is_a_clear_error(tiny_export, tmp_path, args, stdin, phrase):
    (tmp_path / "LATIN1").write_bytes(b"ok\ncaf\xe9\n")
    (tmp_path / "JSONL").write_text('{"prompt": "\\ud800"}\n')
    args = [str(tmp_path / a) if a in ("LATIN1", "JSONL") else a for a in args]
    r = gen(tiny_export, *args, input=stdin)
    assert r.exit_code == 1 and r.stdout == "", r.output
    assert r.stderr.startswith("error: ") and phrase in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--seed", "-1"),
        ("--seed", str(2**64)),
        ("--threads", "0"),
        ("--threads", "100000"),
        ("-n", "0"),
        ("--max-new-tokens", "-3"),
        ("--min-new-tokens", "-1"),
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--top-p", "-0.1"),
        ("--temperature", "-0.5"),
        ("--top-k", "-1"),
    ],
    ids=" ".join,
)
def test_out_of_range_options_are_refused_by_click(tiny_export, args):
    r = gen(tiny_export, "-p", "x", *args)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output  # a usage error, no traceback
    assert "Invalid value for" in r.stderr and args[0] in r.stderr and "is not in the range" in r.stderr


@pytest.mark.parametrize("args", [("--temperature", "nan"), ("--top-p", "nan"), ("--temperature", "inf")])
def test_non_finite_values_are_a_clear_error(tiny_export, args):
    r = gen(tiny_export, "-p", "x", "--do-sample", *args)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output  # click's usage error
    assert f"Invalid value for '{args[0]}'" in r.stderr and "not a finite number" in r.stderr, r.stderr
