"""A session that keeps its KV cache (Generator.session(), `generate -i`): each turn feeds the graph only what the
cache lacks, and every turn equals a fresh generate on the same context, on both graph kinds; the context
overflow path, Ctrl-C, open streams, /reset and /quit."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpt2edge.errors import GenerationError
from gpt2edge.interactive import BANNER, run_interactive
from gpt2edge.runtime import Generator
from gpt2edge.runtime.conversation import ContextOverflow, ContextOverflowWarning
from gpt2edge.runtime.decoding.generate import generate

REPO = Path(__file__).resolve().parents[2]
TURNS = ["The river rose and", " the city", " was quiet. Then", " children"]
GREEDY = dict(ignore_eos=True, do_sample=False)


@pytest.fixture(scope="module", params=["concat", "shared"])
def gen(request) -> Generator:
    return Generator(request.getfixturevalue("tiny_export" if request.param == "concat" else "tiny_export_shared"))


def counting(session) -> list[int]:
    """Record the number of tokens (S of the (1, S) ids) of every forward the session's OrtLM runs."""
    calls: list[int] = []
    real = session.lm.forward

    def forward(ids, mask, positions):
        calls.append(ids.shape[1])
        return real(ids, mask, positions)

    session.lm.forward = forward
    return calls


def fresh(gen: Generator, context: list[int], n: int, **kw) -> list[int]:
    """What a new generation on these token ids gives (one prefill of the whole context)."""
    params = gen.sampling_params(max_new_tokens=n, **{**GREEDY, **kw})
    return generate(gen.lm, gen.tokenizer, [list(context)], params, gen.pad_token_id).generated[0]


def test_each_turn_prefills_only_its_new_tokens_and_equals_a_fresh_generate(gen):
    session = gen.session()
    calls = counting(session)
    history: list[int] = []
    for text in TURNS:
        calls.clear()
        new = gen.tokenizer.encode(text)
        r = session.generate(text, max_new_tokens=12, **GREEDY)
        assert r.prompt_token_ids == history + new
        # one forward of what the cache lacked (the previous turn's last token and this text), then one per token:
        # the prefill does not grow with the history
        assert calls == [len(new) + (len(history) > 0)] + [1] * 11
        assert session.last_prefill_tokens == calls[0]
        assert r.token_ids == fresh(gen, history + new, 12)
        history += new + r.token_ids
        assert session.token_ids == history and session.lm.past_len == len(history) - 1
    # sampling: the repetition penalty sees the whole context, as a fresh generate's does
    sampled = dict(do_sample=True, temperature=0.8, top_k=20, repetition_penalty=1.3, seed=2)
    r = session.generate(" more", max_new_tokens=8, ignore_eos=True, **sampled)
    assert r.token_ids == fresh(gen, r.prompt_token_ids, 8, **sampled)
    assert session.lm.cache.allocations == 1  # reserved once for n_positions


def test_stream_gives_the_same_turns_as_generate(gen):
    a, b = gen.session(), gen.session()
    for text in TURNS[:3]:
        result: list = []
        pieces = "".join(a.stream(text, result=result, max_new_tokens=10, ignore_eos=True))
        r = b.generate(text, max_new_tokens=10, ignore_eos=True)
        assert pieces == result[0].text == r.text and result[0].token_ids == r.token_ids
    assert a.token_ids == b.token_ids


def test_append_generate_without_text_and_an_empty_context(gen):
    s = gen.session()
    assert s.generate(max_new_tokens=4, **GREEDY).prompt_token_ids == [gen.bos_token_id]  # GPT-2's start token
    s.reset()
    ids = s.append("The river") + s.append(" rose")
    assert s.token_ids == ids
    calls = counting(s)
    r = s.generate(max_new_tokens=6, **GREEDY)
    assert calls[0] == len(ids) and r.token_ids == fresh(gen, ids, 6)
    calls.clear()
    again = s.generate(max_new_tokens=6, **GREEDY)  # nothing new: only the last generated token is fed
    assert calls[0] == 1 and again.token_ids == fresh(gen, ids + r.token_ids, 6)


def test_reset_forgets_the_context(gen):
    s = gen.session()
    s.generate("The river rose", max_new_tokens=8, **GREEDY)
    s.reset()
    assert s.token_ids == []
    r = s.generate(" the city", max_new_tokens=8, **GREEDY)
    assert r.prompt_token_ids == gen.tokenizer.encode(" the city")
    assert r.token_ids == fresh(gen, r.prompt_token_ids, 8)


def test_overflow_drops_the_oldest_tokens_and_equals_a_fresh_generate_on_the_kept_ones(gen):
    notices: list[ContextOverflow] = []
    s = gen.session(on_overflow=notices.append)
    calls = counting(s)
    N, n = s.n_positions, 40
    history: list[int] = []
    overflows = 0
    for k in range(6):
        text = TURNS[k % len(TURNS)]
        new = gen.tokenizer.encode(text)
        calls.clear()
        r = s.generate(text, max_new_tokens=n, **GREEDY)
        context = history + new
        if len(context) + n > N:
            kept = context[-min(N - n, N // 2) :]  # the newest tokens, half the positions
            assert notices[-1] == ContextOverflow(len(context) - len(kept), len(kept), N)
            assert calls[0] == len(kept)  # absolute positions: everything kept is prefilled again
            overflows += 1
        else:
            kept = context
            assert calls[0] == len(new) + (len(history) > 0)
        assert r.prompt_token_ids == kept
        assert r.token_ids == fresh(gen, kept, n)
        history = kept + r.token_ids
        assert s.token_ids == history
    assert overflows >= 2 and len(notices) == overflows
    assert s.lm.cache.allocations == 1


def test_overflow_without_a_callback_is_a_warning(gen):
    s = gen.session()
    s.append("x " * 150)
    assert len(s.token_ids) > s.n_positions
    with pytest.warns(ContextOverflowWarning, match="dropped the oldest"):
        r = s.generate(max_new_tokens=8, **GREEDY)
    assert len(r.prompt_token_ids) == s.n_positions // 2
    assert r.token_ids == fresh(gen, r.prompt_token_ids, 8)


def test_bad_turn_parameters_are_refused_and_change_nothing(gen):
    s = gen.session()
    s.append("The river")
    before = s.token_ids
    with pytest.raises(GenerationError, match=r"no room for any context .* at most 127\.$"):
        s.generate(" rose", max_new_tokens=128)
    with pytest.raises(GenerationError):
        s.stream(" rose", max_new_tokens=0)
    with pytest.raises(GenerationError, match="logprobs"):
        s.generate(" rose", logprobs=-1)
    assert s.token_ids == before


def test_ctrl_c_in_a_callback_ends_the_turn_and_keeps_its_tokens(gen):
    s = gen.session()

    def interrupt_at_3(step):
        if step.index == 3:
            raise KeyboardInterrupt

    r = s.generate("The river rose", max_new_tokens=20, callback=interrupt_at_3, **GREEDY)
    assert r.finish_reason == "interrupted" and len(r.token_ids) == 4
    calls = counting(s)
    new = gen.tokenizer.encode(" and")
    r2 = s.generate(" and", max_new_tokens=6, **GREEDY)
    assert calls[0] == len(new) + 1  # the cache was intact: nothing is fed twice
    assert r2.token_ids == fresh(gen, r.prompt_token_ids + r.token_ids + new, 6)


def test_ctrl_c_inside_a_forward_rebuilds_the_cache(gen):
    s = gen.session()
    real = s.lm.forward
    n = 0

    def forward(ids, mask, positions):
        nonlocal n
        n += 1
        out = real(ids, mask, positions)
        if n == 4:
            raise KeyboardInterrupt  # after the graph ran, before the loop saw its output
        return out

    s.lm.forward = forward
    r = s.generate("The river rose", max_new_tokens=20, **GREEDY)
    assert r.finish_reason == "interrupted" and len(r.token_ids) == 3
    s.lm.forward = real
    calls = counting(s)
    context = r.prompt_token_ids + r.token_ids + gen.tokenizer.encode(" and")
    r2 = s.generate(" and", max_new_tokens=6, **GREEDY)
    assert calls[0] == len(context)  # the whole context again: the interrupted step's state is not trusted
    assert r2.token_ids == fresh(gen, context, 6)


def test_an_open_stream_blocks_the_session_and_closing_it_keeps_its_tokens(gen):
    s = gen.session()
    unstarted = s.stream("never", max_new_tokens=4)  # a stream not yet read has done nothing
    pieces = s.stream("The river rose", max_new_tokens=30, ignore_eos=True)
    next(pieces)
    with pytest.raises(GenerationError, match="stream is still open"):
        s.generate(" and", max_new_tokens=4)
    with pytest.raises(GenerationError, match="stream is still open"):
        s.append(" and")
    pieces.close()
    unstarted.close()
    kept = s.token_ids
    assert len(kept) > len(gen.tokenizer.encode("The river rose")) and "never" not in s.text
    calls = counting(s)
    new = gen.tokenizer.encode(" and")
    r = s.generate(" and", max_new_tokens=6, **GREEDY)
    assert calls[0] == len(new) + 1 and r.token_ids == fresh(gen, kept + new, 6)


def test_session_turns_can_record_logprobs(gen):
    s = gen.session()
    s.generate("The river", max_new_tokens=4, **GREEDY)
    r = s.generate(" rose", max_new_tokens=5, logprobs=2, **GREEDY)
    assert [x.token_id for x in r.logprobs] == r.token_ids
    assert all(x.top_logprobs[0].token_id == x.token_id for x in r.logprobs)  # greedy takes the top token


class InterruptingWriter(io.StringIO):
    """stdout whose second write raises KeyboardInterrupt, as Ctrl-C while the model writes would."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        if self.writes == 2:
            raise KeyboardInterrupt
        return super().write(s)


def test_interactive_ctrl_c_while_writing_ends_the_turn_only(tiny_export):
    gen = Generator(tiny_export)
    err = io.StringIO()
    opts = dict(max_new_tokens=30, ignore_eos=True, do_sample=False)
    status = run_interactive(gen, None, opts, io.StringIO("The river rose\n and\n"), InterruptingWriter(), err)
    lines = err.getvalue().splitlines()
    assert status == 0 and lines[0] == BANNER
    assert lines[1].startswith("[interrupted | context ") and lines[2].startswith("[length: 30 tokens | prefill ")
    assert "Traceback" not in err.getvalue()


def run_cli(export: Path, stdin: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    cmd = [sys.executable, "-m", "gpt2edge.cli", "generate", str(export), "-i", *args]
    return subprocess.run(cmd, input=stdin.encode(), capture_output=True, timeout=120, env=env)


def test_cli_interactive_turns_reset_quit_and_end_of_input(tiny_export):
    gen = Generator(tiny_export)
    s = gen.session()
    kw = dict(max_new_tokens=8, do_sample=False)
    a = s.generate("The river rose", **kw).text
    b = s.generate(" and the city", **kw).text
    s.reset()
    c = s.generate("The river rose", **kw).text
    p = run_cli(tiny_export, "The river rose\n and the city\n/reset\nThe river rose\n/quit\nnever read\n", "-n", "8")
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert p.stdout.decode() == f"{a}\n{b}\n{c}\n"  # stdout: the model's text only
    status = [line for line in err.splitlines() if " new tokens in " in line]
    assert len(status) == 3 and f"prefill {len(gen.tokenizer.encode(' and the city')) + 1} new tokens" in status[1]
    assert "[context cleared]" in err and "Traceback" not in err
    eof = run_cli(tiny_export, "The river rose", "-n", "8")  # no /quit, no final newline: end of input ends it
    assert eof.returncode == 0 and eof.stdout.decode() == f"{a}\n"


def test_cli_interactive_overflow_notice_and_refusals(tiny_export):
    p = run_cli(tiny_export, "The river rose\n and the city\n then\n", "-n", "60", "--ignore-eos")
    err = p.stderr.decode()
    assert p.returncode == 0, err
    notices = [line for line in err.splitlines() if line.startswith("[context full")]
    assert len(notices) == 1 and "dropped the oldest" in notices[0]
    too_long = run_cli(tiny_export, "x\n", "-n", "128")
    assert too_long.returncode == 1 and too_long.stdout == b""
    assert too_long.stderr.decode().strip().splitlines() == [
        "error: max_new_tokens=128 leaves no room for any context in the model's 128 positions; lower it to at most "
        "127."
    ]
    combo = run_cli(tiny_export, "", "--json")
    assert combo.returncode == 2 and b"-i takes at most one -p" in combo.stderr


def test_cli_interactive_ctrl_c_at_the_prompt_exits_130_without_traceback(tiny_export):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "gpt2edge.cli", "generate", str(tiny_export), "-i"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    guard = threading.Timer(120, p.kill)
    guard.start()
    try:
        seen = []
        while not seen or not seen[-1].startswith(BANNER):  # the model is loaded and it waits for a line
            line = p.stderr.readline().decode()
            assert line, "".join(seen)
            seen.append(line)
        p.send_signal(signal.SIGINT)
        out, rest = p.communicate(timeout=60)
    finally:
        guard.cancel()
    assert p.returncode == 130 and out == b""
    assert b"Traceback" not in rest


@pytest.mark.filterwarnings("ignore::gpt2edge.runtime.conversation.ContextOverflowWarning")
@pytest.mark.parametrize("kind", ["tiny_export", "tiny_export_shared"])
def test_without_io_binding_the_session_gives_the_same_turns(kind, request):
    export = request.getfixturevalue(kind)
    bound, plain = Generator(export).session(), Generator(export, io_binding=False).session()
    for text in TURNS * 2:  # long enough to overflow once
        a = bound.generate(text, max_new_tokens=20, **GREEDY)
        assert plain.generate(text, max_new_tokens=20, **GREEDY).token_ids == a.token_ids
    assert bound.token_ids == plain.token_ids
