"""Memory is bounded before work starts, on every input: a request whose estimate does not fit in the available
memory is refused with one line naming the estimate (in the library, so the Python API is protected too).
Cheap: available memory is capped with GPT2EDGE_MAX_MEMORY (or monkeypatched), nothing big is allocated."""

from __future__ import annotations

import contextlib
import os
import select
import threading

import pytest
from click.testing import CliRunner

from gpt2edge.budget import memory
from gpt2edge.cli import main
from gpt2edge.errors import GenerationError
from gpt2edge.runtime import Generator


@pytest.fixture(scope="module")
def gen(tiny_export) -> Generator:
    return Generator(tiny_export)


@pytest.fixture
def cap(monkeypatch):
    def set_cap(size: str) -> None:
        monkeypatch.setenv(memory.ENV, size)

    return set_cap


# (kwargs of generate, prompts): each grows one dimension of what a generation holds
HUGE = [
    ({"num_beams": 50_000, "max_new_tokens": 2}, ["hi"]),
    ({"num_return_sequences": 100_000, "do_sample": True, "max_new_tokens": 2}, ["hi"]),
    ({"num_return_sequences": 2**62, "do_sample": True, "max_new_tokens": 2}, ["hi"]),
    ({"num_beams": 2**40, "num_return_sequences": 2, "max_new_tokens": 2}, ["hi"]),
    ({"logprobs": 399, "max_new_tokens": 100, "ignore_eos": True}, ["hi"] * 64),
    ({"max_new_tokens": 2}, ["hi"] * 10_000),
]


@pytest.mark.parametrize(("kwargs", "prompts"), HUGE, ids=lambda v: str(v)[:40])
def test_a_generation_over_the_memory_is_refused_before_work(gen, cap, kwargs, prompts):
    cap("64M")
    lm_before = gen._pool.primary.cache.allocations
    with pytest.raises(GenerationError, match=r"would hold about .* of memory \(.*\), more than the 67.1 MB"):
        gen.generate(prompts, **kwargs)
    assert gen._pool.primary.cache.allocations == lm_before  # no KV cache was reserved


def test_what_fits_still_runs(gen, cap):
    cap("64M")
    out = gen.generate("hi", num_beams=4, num_return_sequences=2, max_new_tokens=3)
    assert len(out) == 2
    out = gen.generate(["hi", "there"], max_new_tokens=3, logprobs=5)
    assert len(out[0].logprobs) == 3


def test_the_estimate_scales_with_every_dimension(gen):
    from gpt2edge.runtime.model.memory_plan import generation_estimate

    base = generation_estimate(gen.folder, [[1, 2, 3]], 10).total
    assert generation_estimate(gen.folder, [[1, 2, 3]] * 4, 10).total > 3 * base
    assert generation_estimate(gen.folder, [[1, 2, 3]], 10, num_beams=4).total > 3 * base
    assert generation_estimate(gen.folder, [[1, 2, 3]], 10, num_return_sequences=4).total > 3 * base
    assert generation_estimate(gen.folder, [[1, 2, 3]], 100).total > generation_estimate(gen.folder, [[1]], 10).total
    assert generation_estimate(gen.folder, [[1, 2, 3]], 10, logprobs=100).total > 10 * base


def test_stream_is_bounded_too(gen, cap):
    cap("1M")
    with pytest.raises(GenerationError, match="would hold about"):
        next(gen.stream("hi", max_new_tokens=100, logprobs=399, ignore_eos=True))


@pytest.mark.parametrize(
    "args",
    [
        ["--num-beams", "50000", "-n", "2"],
        ["--num-return-sequences", "100000", "--do-sample", "-n", "2"],
        ["--num-return-sequences", str(2**62), "--do-sample", "-n", "2"],
        ["--logprobs", "399", "-n", "100", "--json"],
    ],
)
def test_cli_prints_one_error_line_naming_the_estimate(tiny_export, args):
    r = CliRunner().invoke(main, ["generate", str(tiny_export), "-p", "hi", *args], env={memory.ENV: "32M"})
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: This generation would hold about"), r.stderr
    assert "KV cache" in lines[0] or "log-probs" in lines[0]


def test_available_memory_is_the_smallest_known_limit(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 8 << 30)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: 3 << 30)
    monkeypatch.setattr(memory, "_address_space_left", lambda: None)
    monkeypatch.delenv(memory.ENV, raising=False)
    assert memory.available_bytes() == 3 << 30
    monkeypatch.setenv(memory.ENV, "1.5G")
    assert memory.available_bytes() == int(1.5 * (1 << 30))
    monkeypatch.setenv(memory.ENV, "lots")
    with pytest.raises(memory.Gpt2EdgeError, match="is not a size"):
        memory.available_bytes()


# --- trim-vocab --keep-from: streamed corpus counting -------------------------------------------------------

CORPUS_TEXT = (
    "def f(x):\n    return x  # ünïcödé ✓ 漢字\n\n\n  indented   spaces\t\ttabs<|endoftext|>tail\r\n" * 50
    + "x" * 3000  # a long run with no space
)


def _whole_counts(tok, texts, V):
    import numpy as np

    counts = np.zeros(V, dtype=np.int64)
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        counts += np.bincount(np.asarray(enc.ids, dtype=np.int64), minlength=V)
    return counts


@pytest.mark.parametrize(("block", "batch"), [(7, 13), (64, 100), (4096, 1 << 20)])
def test_streamed_counts_equal_whole_file_counts(tiny_export, tmp_path, monkeypatch, block, batch):
    """Cut at odd block sizes (inside multi-byte characters, inside words): the counts do not change."""
    import numpy as np

    from gpt2edge.runtime.model.tokenizer import load_tokenizer
    from gpt2edge.trim import corpus

    monkeypatch.setattr(corpus, "BLOCK", block)
    monkeypatch.setattr(corpus, "BATCH", batch)
    tok = load_tokenizer(tiny_export / "tokenizer.json")
    V = tok.get_vocab_size()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.py").write_text(CORPUS_TEXT)
    (tmp_path / "c" / "small.txt").write_text("hello world\n")
    (tmp_path / "c" / "empty.txt").write_text("")
    (tmp_path / "c" / "bin.pyc").write_bytes(b"\x00\xff" * 100)
    (tmp_path / "c" / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    got = corpus.count_corpus(tok, [tmp_path / "c"], V)
    want = _whole_counts(tok, [CORPUS_TEXT, "hello world\n", ""], V)
    assert np.array_equal(got.counts, want)
    assert (got.files, got.skipped) == (3, 2)


def test_endless_binary_corpus_is_skipped_at_once(tiny_export):
    """/dev/zero is not text: its first block says so, nothing more is read."""
    from gpt2edge.errors import TrimError
    from gpt2edge.trim.keep import keep_from_corpus

    with pytest.raises(TrimError, match="holds no UTF-8 text"):
        keep_from_corpus(tiny_export / "tokenizer.json", 400, [0], [__import__("pathlib").Path("/dev/zero")])


ENDLESS = """
import sys, threading
from gpt2edge.trim import corpus
corpus.PROGRESS_EVERY_S = 0.2
from gpt2edge.cli import main
main(["trim-vocab", sys.argv[1], "-o", sys.argv[2], "--keep-from", sys.argv[3], "--no-report"])
"""


def test_endless_fifo_corpus_streams_in_constant_memory_and_stops_on_ctrl_c(tiny_export, tmp_path):
    """A FIFO that never ends: progress lines (not a TTY), flat memory, and Ctrl-C ends it."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    fifo = tmp_path / "endless"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with endless_fifo(fifo, b"the quick brown fox jumps over the lazy dog\n" * 2000):
        p = subprocess.Popen(
            [sys.executable, "-c", ENDLESS, str(tiny_export), str(tmp_path / "out"), str(fifo)],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines, rss = [], []
        try:
            while len(lines) < 6:
                line = p.stderr.readline()
                assert line, "the process ended before printing progress"
                if line.startswith("trim-vocab: counted"):
                    lines.append(line)
                    rss.append(int(Path(f"/proc/{p.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)  # a hang guard, not a measure: Ctrl-C ends the count at its next block
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert p.returncode != 0 and not (tmp_path / "out").exists()
    assert rss[-1] < rss[1] + (64 << 20), rss  # flat: the corpus is never held
    assert "MB" in lines[-1]


# --- huge and endless text inputs: score, generate -f, --text -----------------------------------------------


@contextlib.contextmanager
def endless_fifo(path, block: bytes = b"an endless line of text\n" * 4096):
    """A FIFO at `path` whose writer thread writes `block` until the reader goes away or the with-block ends.

    The thread always ends, cleanly, by the end of the with-block: its writes are unbuffered (no flush at close
    to fail with BrokenPipeError once the reader left), and a writer still waiting for a reader (the command
    never opened the FIFO) or for room in the pipe is let through by a reader of its own here."""
    os.mkfifo(path)
    stop = threading.Event()

    def writer() -> None:
        fd = os.open(path, os.O_WRONLY)  # waits for a reader
        try:
            while not stop.is_set():
                os.write(fd, block)
        except BrokenPipeError:  # the reader left: the stream ends
            pass
        finally:
            os.close(fd)

    thread = threading.Thread(target=writer, name="endless-fifo")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        # a reader of our own lets a writer blocked in open() through, and drained, one blocked in write()
        # (it then sees stop); select() waits for data, never for a time
        rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while thread.is_alive():
                if select.select([rfd], [], [], 0.1)[0]:
                    with contextlib.suppress(BlockingIOError):
                        os.read(rfd, 1 << 20)
        finally:
            os.close(rfd)
        thread.join()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("reads", [0, 10, 1 << 20])
def test_the_fifo_writer_ends_cleanly_whether_the_reader_reads_or_never_comes(tmp_path, reads):
    with endless_fifo(tmp_path / "fifo", b"x" * 100_000):
        if reads:
            with open(tmp_path / "fifo", "rb") as f:
                assert len(f.read(reads)) == reads
    assert not [t for t in threading.enumerate() if t.name == "endless-fifo"]


@pytest.mark.parametrize("source", ["/dev/zero", "fifo", "big"])
@pytest.mark.parametrize("command", ["score", "generate -f"])
def test_huge_or_endless_text_is_refused_after_a_bounded_read(tiny_export, tmp_path, monkeypatch, source, command):
    from gpt2edge import prompt_input
    from gpt2edge.budget import inputs

    monkeypatch.setattr(inputs, "MAX_SCORE_BYTES", 1 << 20)
    monkeypatch.setattr(prompt_input, "MAX_PROMPT_BYTES", 1 << 20)
    fifo = contextlib.nullcontext()
    if source == "fifo":
        path = tmp_path / "fifo"
        fifo = endless_fifo(path)
    elif source == "big":
        path = tmp_path / "big.txt"
        path.write_bytes(b"hello world\n" * 200_000)  # 2.4 MB: over the (patched) limit
    else:
        path = source
    args = (
        ["score", str(tiny_export), str(path)]
        if command == "score"
        else ["generate", str(tiny_export), "-f", str(path)]
    )
    with fifo:
        r = CliRunner().invoke(main, args)
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("error: ") and "holds more than 1 MB (reading stopped there)" in r.stderr, r.stderr


def test_score_and_prompt_stdin_are_bounded(tiny_export, monkeypatch):
    from gpt2edge import prompt_input
    from gpt2edge.budget import inputs

    monkeypatch.setattr(inputs, "MAX_SCORE_BYTES", 1000)
    monkeypatch.setattr(prompt_input, "MAX_PROMPT_BYTES", 1000)
    big = "word " * 1000
    for args in (["score", str(tiny_export)], ["generate", str(tiny_export), "-p", "-"]):
        r = CliRunner().invoke(main, args, input=big)
        assert r.exit_code == 1 and r.stderr.startswith("error: stdin holds more than 1 kB"), r.stderr


def test_report_text_is_cut_at_its_limit_with_a_note(tmp_path, capsys, monkeypatch):
    from gpt2edge import prompt_input

    monkeypatch.setattr(prompt_input, "MAX_REPORT_TEXT_BYTES", 1000)
    f = tmp_path / "t.txt"
    f.write_text("é" * 5000)  # two bytes a character: the cut falls inside one at an odd limit
    monkeypatch.setattr(prompt_input, "MAX_REPORT_TEXT_BYTES", 1001)
    text = prompt_input.read_text_file(f)
    assert text == "é" * 500
    assert "note: the --text file" in capsys.readouterr().err
    assert prompt_input.read_text_file("/dev/zero").count("\0") == 1001  # endless: its start only


def test_scorer_library_refuses_a_text_over_the_memory(tiny_export, cap):
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.score import Scorer

    cap("1M")
    with pytest.raises(GenerationError, match="Scoring this text would hold about"):
        Scorer(ModelFolder.open(tiny_export, verify=False)).score("hello world " * 20_000)


def test_bench_text_prompts_read_an_endless_file_bounded(gen, monkeypatch):
    from pathlib import Path

    from gpt2edge import prompt_input
    from gpt2edge.bench.speculative import text_prompts

    monkeypatch.setattr(prompt_input, "MAX_REPORT_TEXT_BYTES", 1000)
    (ids,) = text_prompts(gen, (Path("/dev/zero"),), 8)
    assert len(ids) == 8


@pytest.mark.parametrize("n_positions", [10**7, 10**12])
def test_a_session_on_an_absurd_n_positions_is_refused(tiny_export, tmp_path, cap, n_positions):
    """A session reserves its cache for every position at once: an edited manifest's n_positions is checked."""
    import json
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(tiny_export, folder)
    m = json.loads((folder / "manifest.json").read_text())
    m["dims"]["n_positions"] = n_positions
    (folder / "manifest.json").write_text(json.dumps(m))
    cap("256M")
    with pytest.raises(GenerationError, match=r"A session would hold about .*KV cache 1 rows x"):
        Generator(folder).session()
    r = CliRunner().invoke(main, ["generate", str(folder), "-i"], input="hello\n", env={memory.ENV: "256M"})
    assert r.exit_code == 1 and r.stderr.startswith("error: A session would hold about"), r.stderr
