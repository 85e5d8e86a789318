"""The CLI as llama.cpp and transformers users expect it (issue 21, item 6): separators and finish reasons,
-f as one prompt, -e escapes, the common aliases, reports on one stream, parity's thresholds, the report's
text, score's stdin note, progress lines off a terminal, the speculative line, complete help, the demo."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.cli.escapes import process_escapes
from tests.support import cli

REPO = Path(__file__).resolve().parents[2]


def gen(folder, *args, input=None):
    return cli("generate", folder, *args, input=input)


def results(r) -> list[dict]:
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    return obj["results"] if "results" in obj else [obj]


# --- separators and finish reasons --------------------------------------------------------------------------


def test_several_results_are_separated_and_every_one_says_why_it_finished(tiny_export):
    one = gen(tiny_export, "-p", "The river", "-n", "3")  # streamed
    assert one.exit_code == 0 and "---" not in one.stdout and "[finish: length]" in one.stderr, one.output
    for extra in ((), ("--sequential",), ("--no-stream",)):
        r = gen(tiny_export, "-p", "The river", "-p", "a\nb", "-n", "3", *extra)
        lines = r.stdout.splitlines()
        assert lines[0] == "--- prompt 1/2 ---" and "--- prompt 2/2 ---" in lines, (extra, r.stdout)
        assert r.stderr.count("[finish: ") == 2, (extra, r.stderr)
    beams = gen(tiny_export, "-p", "hi", "-n", "3", "--num-beams", "3", "--num-return-sequences", "2")
    seps = [x for x in beams.stdout.splitlines() if x.startswith("---")]
    assert seps == ["--- sequence 1/2 ---", "--- sequence 2/2 ---"], beams.stdout
    both = gen(tiny_export, "-p", "a", "-p", "b", "-n", "2", "--num-beams", "2", "--num-return-sequences", "2")
    seps = [x for x in both.stdout.splitlines() if x.startswith("---")]
    assert seps == [f"--- prompt {p}/2, sequence {s}/2 ---" for p in (1, 2) for s in (1, 2)], both.stdout
    assert both.stderr.count("[finish: length, score ") == 4
    assert json.loads(gen(tiny_export, "-p", "a", "-p", "b", "-n", "2", "--json").stdout)  # --json: pure JSON


# --- -f is one prompt; --batch-file is several ------------------------------------------------------------


def test_f_reads_the_whole_file_as_one_prompt_like_llama_cpp(tiny_export, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("def add(a, b):\n\n    return a + b\n")  # blank line and all: one prompt
    assert [x["prompt"] for x in results(gen(tiny_export, "-f", f, "-n", "2", "--json"))] == [
        "def add(a, b):\n\n    return a + b"
    ]
    g = tmp_path / "q.txt"
    g.write_text('{"prompt": "x"}\n')  # JSON text is just text to -f
    two = results(gen(tiny_export, "-f", f, "--file", g, "-n", "2", "--json"))
    assert [x["prompt"] for x in two] == ["def add(a, b):\n\n    return a + b", '{"prompt": "x"}']
    piped = results(gen(tiny_export, "-f", "-", "-n", "2", "--json", input="line 1\nline 2\n"))
    assert [x["prompt"] for x in piped] == ["line 1\nline 2"]


def test_batch_file_keeps_one_prompt_per_line_or_jsonl(tiny_export, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first\n\nsecond\n")
    assert [x["prompt"] for x in results(gen(tiny_export, "--batch-file", f, "-n", "2", "--json"))] == [
        "first",
        "second",
    ]
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "a\\nb"}\n{"prompt": "c"}\n')
    got = results(gen(tiny_export, "--batch-file", j, "--format", "jsonl", "-n", "2", "--json"))
    assert [x["prompt"] for x in got] == ["a\nb", "c"]
    mixed = results(gen(tiny_export, "-p", "p", "-f", f, "--batch-file", j, "-n", "2", "--json"))
    assert [x["prompt"] for x in mixed] == ["p", "first\n\nsecond", "a\nb", "c"]  # -p, then -f, then --batch-file


# --- -e escapes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("a\\nb", "a\nb"),
        ("\\t\\r\\\\", "\t\r\\"),
        ("\\'\\\"", "'\""),
        ("\\x41\\x7a", "Az"),
        ("C:\\path\\q", "C:\\path\\q"),  # unknown escapes are kept as typed
        ("end\\", "end\\"),
        ("\\xZZ", "\\xZZ"),
    ],
)
def test_process_escapes_as_llama_cpp(typed, meant):
    assert process_escapes(typed) == meant


def test_escape_flag_applies_to_prompts_and_stop_strings(tiny_export):
    literal = results(gen(tiny_export, "-p", "a\\nb", "-n", "2", "--json"))[0]
    assert literal["prompt"] == "a\\nb"  # without -e a backslash is a backslash
    escaped = results(gen(tiny_export, "-e", "-p", "a\\nb", "-n", "2", "--json"))[0]
    assert escaped["prompt"] == "a\nb"
    # a stop string given as \n stops at the first newline the model writes
    free = results(gen(tiny_export, "-p", "The", "-n", "60", "--ignore-eos", "--json"))[0]
    if "\n" in free["text"]:
        stopped = results(gen(tiny_export, "-e", "-p", "The", "-n", "60", "--ignore-eos", "--stop", "\\n", "--json"))
        assert stopped[0]["text"] == free["text"].split("\n")[0] and stopped[0]["finish_reason"] == "stop"


# --- llama.cpp's spellings ---------------------------------------------------------------------------------


def test_llama_cpp_aliases_mean_the_same_options(tiny_export):
    long = ["--max-new-tokens", "6", "--do-sample", "--temperature", "0.7", "--repetition-penalty", "1.3",
            "--seed", "5", "--threads", "1"]  # fmt: skip
    short = ["--n-predict", "6", "--do-sample", "--temp", "0.7", "--repeat-penalty", "1.3", "-s", "5", "-t", "1"]
    a = results(gen(tiny_export, "-p", "The river", "--json", *long))[0]
    b = results(gen(tiny_export, "-p", "The river", "--json", *short))[0]
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 6
    c = results(gen(tiny_export, "-p", "The river", "--json", "-n", "6", "--do-sample", "--temp", "0.7",
                    "--repeat-penalty", "1.3", "-s", "6", "-t", "1"))[0]  # fmt: skip
    assert c["token_ids"] != a["token_ids"]  # -s is the seed


def test_every_option_has_help_and_no_short_flag_clashes():
    for name, cmd in main.commands.items():
        seen: dict[str, str] = {}
        for p in cmd.params:
            if not isinstance(p, click.Option):
                continue
            assert p.help, (name, p.opts)  # e.g. --device and bench's --batch
            for o in p.opts + p.secondary_opts:
                assert o not in seen, (name, o, seen.get(o), p.name)
                seen[o] = p.name
        text = CliRunner().invoke(main, [name, "--help"]).output
        assert "None]" not in text and "<=None" not in text, (name, text)
    assert "-t" in main.commands["score"].params[[p.name for p in main.commands["score"].params].index("threads")].opts
    assert "-s" in next(p for p in main.commands["random-checkpoint"].params if p.name == "seed").opts


# --- reports: one stream, thresholds, the text scored ------------------------------------------------------


@pytest.fixture(scope="module")
def int8_with_text(tiny_export, tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "domain.txt"
    text.write_text("def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 4)
    out = tmp_path_factory.mktemp("q") / "int8"
    r = cli("quantize", tiny_export, "-o", out, "--mode", "int8", "--text", text)
    assert r.exit_code == 0, r.output
    assert f"text scored                --text {text}" in r.stdout and "note:" not in r.output
    return out, text


def test_a_text_given_at_quantize_time_is_recorded_and_scored_by_later_reports(tiny_export, int8_with_text):
    out, text = int8_with_text
    manifest = json.loads((out / "manifest.json").read_text())
    assert "quality_text.txt" in manifest["files"] and (out / "quality_text.txt").read_text() == text.read_text()
    assert manifest["quality"]["text_scored"] == f"--text {text}"
    r = cli("parity", tiny_export, out)
    assert r.exit_code == 0 and str(out / "quality_text.txt") in r.stdout and "note:" not in r.output, r.output
    plain = cli("parity", tiny_export, tiny_export)  # nothing recorded: the built-in sample, and a note
    assert "text scored                the built-in English sample" in plain.stdout
    assert "note: the quality report scores the built-in English sample" in plain.stdout


def test_parity_states_the_thresholds_it_checked(tiny_export, int8_with_text):
    out, _ = int8_with_text
    none = cli("parity", tiny_export, out)
    assert "thresholds: none checked (pass --max-kl" in none.stdout
    r = cli("parity", tiny_export, out, "--max-kl", "10", "--max-logprob-diff", "0", "--json")
    assert r.exit_code == 1, r.output
    checks = json.loads(r.stdout)["thresholds"]
    assert [(c["option"], c["ok"]) for c in checks] == [("--max-kl", True), ("--max-logprob-diff", False)]
    assert "mean_kl <= 10 (--max-kl)" in r.stderr and "max_abs_logprob_diff <= 0 (--max-logprob-diff)" in r.stderr
    assert "FAILED" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("error: Parity thresholds")


def test_trim_vocab_reports_on_stdout_like_every_command(tiny_export, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i) for i in range(0, 400, 2)))
    r = cli("trim-vocab", tiny_export, "-o", tmp_path / "t", "--keep-ids", ids)
    assert r.exit_code == 0 and "trimmed vs full:" in r.stdout and "trimmed vs full:" not in r.stderr, r.output
    j = cli("trim-vocab", tiny_export, "-o", tmp_path / "j", "--keep-ids", ids, "--json")
    assert json.loads(j.stdout)["trim"]["quality"]["text_scored"] and "trimmed vs full:" in j.stderr


# --- score's stdin, progress lines, the speculative line -----------------------------------------------------


def test_score_on_a_terminal_says_it_reads_stdin(tiny_export):
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "gpt2edge.cli", "score", str(tiny_export)], stdin=slave,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    os.close(slave)
    try:
        first = p.stderr.readline()
        os.write(master, b"the river rose and the city was quiet\n\x04")  # a line, then Ctrl-D
        out, _ = p.communicate(timeout=120)
    finally:
        os.close(master)
    assert first.startswith("reading the text to score from stdin (end it with Ctrl-D)"), first
    assert p.returncode == 0 and "perplexity" in out
    piped = cli("score", tiny_export, input="the river rose and the city")
    assert piped.exit_code == 0 and "reading the text" not in piped.output  # a pipe: no note


def test_long_jobs_print_progress_lines_off_a_terminal(tiny_export, tmp_path, monkeypatch):
    from gpt2edge import progress

    with progress.Progress(3, "job", file=(log := open(tmp_path / "log", "w")), period_s=0.02) as bar:
        bar.set_postfix_str("working")
        time.sleep(0.1)
        bar.update()
        time.sleep(0.1)
    log.close()
    lines = (tmp_path / "log").read_text().splitlines()
    assert lines and lines[0].startswith("job: step 1/3 (working), ") and lines[-1].startswith("job: step 2/3")
    monkeypatch.setattr(progress, "PERIOD_S", 0.01)
    r = cli("quantize", tiny_export, "-o", tmp_path / "q", "--mode", "int8")
    assert r.exit_code == 0 and "quantize int8: step " in r.stderr, r.stderr


def test_the_speculative_line_says_ms_per_target_step(tiny_export_all):
    r = gen(tiny_export_all, "-p", "one two one two one two", "-n", "8", "--prompt-lookup", "2", "--ignore-eos")
    assert r.exit_code == 0, r.output
    spec = [line for line in r.stderr.splitlines() if line.startswith("[speculative:")]
    assert len(spec) == 1 and " ms per target step | " in spec[0], r.stderr
    assert "ms per target step (mean)" in r.stderr  # the timing line names its unit too


# --- the demo ----------------------------------------------------------------------------------------------


def test_the_demo_says_what_its_model_is_before_any_report():
    lines = (REPO / "scripts" / "demo.sh").read_text().splitlines()
    # the shipped model (models/gpt2-stdlib-mini): a small GPT-2 trained on CPython's standard library
    note = next(i for i, line in enumerate(lines) if line.startswith("echo") and "trained on" in line)
    first_report = next(i for i, line in enumerate(lines) if line.startswith("gpt2edge ") and "export" in line)
    assert note < first_report


def test_a_text_recorded_at_export_is_the_default_of_quantize(tiny_checkpoint, tmp_path):
    text = tmp_path / "domain.txt"
    text.write_text("for i in range(10):\n    print(i)\n" * 6)
    out = tmp_path / "exp"
    r = cli("export", "-m", tiny_checkpoint, out, "--no-validate", "--text", text)
    assert r.exit_code == 0 and (out / "quality_text.txt").read_text() == text.read_text(), r.output
    q = cli("quantize", out, "-o", tmp_path / "q", "--mode", "int8")
    assert q.exit_code == 0 and f"{out / 'quality_text.txt'} (recorded when the folder was made)" in q.stdout
    assert "note:" not in q.output
    assert (tmp_path / "q" / "quality_text.txt").read_text() == text.read_text()  # carried into the variant
