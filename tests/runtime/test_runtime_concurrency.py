"""One Generator, many callers: threads and interleaved streams get exactly the tokens of sequential calls."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gpt2edge.errors import GenerationError
from gpt2edge.runtime import Generator

EXPORTS = ["tiny_export", "tiny_export_shared"]  # the concat and the shared-cache graph

# run in a fresh interpreter: a crash there (the old failure was SIGSEGV / heap corruption) fails the test
# instead of killing pytest
THREADED = textwrap.dedent(
    """
    import json, sys, threading
    from gpt2edge.runtime import Generator

    g = Generator(sys.argv[1])
    n_threads, calls = int(sys.argv[2]), int(sys.argv[3])
    jobs = [
        ("generate", "The river", dict(max_new_tokens=16, do_sample=False, ignore_eos=True)),
        ("generate", ["Visitors walk", "The city at night"], dict(max_new_tokens=12, temperature=0.9, seed=3)),
        ("stream", "Children learned", dict(max_new_tokens=20, top_k=20, seed=5, ignore_eos=True)),
        ("generate", "Students arrive " * 8, dict(max_new_tokens=30, top_p=0.9, seed=1, ignore_eos=True)),
        ("stream", "The weather", dict(max_new_tokens=9, do_sample=False, stop=["e"])),
    ]

    def run(job):
        kind, prompt, kw = job
        if kind == "stream":
            result = []
            text = "".join(g.stream(prompt, result=result, **kw))
            return [[text, result[0].text, result[0].token_ids, result[0].finish_reason]]
        rs = g.generate(prompt, **kw)
        return [[r.text, r.text, r.token_ids, r.finish_reason] for r in (rs if isinstance(rs, list) else [rs])]

    expected = [run(job) for job in jobs]  # sequential: the reference
    errors, mismatches = [], []
    start = threading.Barrier(n_threads)

    def worker(t):
        start.wait()
        for c in range(calls):
            i = (t + c) % len(jobs)
            try:
                got = run(jobs[i])
            except Exception as e:
                errors.append(repr(e))
                continue
            if got != expected[i]:
                mismatches.append([t, c, i, got, expected[i]])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"errors": errors, "mismatches": mismatches}))
    """
)


@pytest.mark.parametrize("export", EXPORTS)
@pytest.mark.parametrize("n_threads", [2, 4])
def test_threads_on_one_generator_match_sequential_calls(request, export, n_threads):
    folder = request.getfixturevalue(export)
    p = subprocess.run(
        [sys.executable, "-c", THREADED, str(folder), str(n_threads), "8"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, f"exit status {p.returncode} (a negative status is a signal): {p.stderr[-2000:]}"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["mismatches"] == []


def _round_robin(*streams):
    """Advance the streams one piece at a time in turn, until all are exhausted; their pieces, per stream."""
    pieces: list[list[str]] = [[] for _ in streams]
    live = dict(enumerate(streams))
    while live:
        for i, s in list(live.items()):
            piece = next(s, None)
            if piece is None:
                del live[i]
            else:
                pieces[i].append(piece)
    return pieces


@pytest.mark.parametrize("export", EXPORTS)
def test_interleaved_streams_in_one_thread_match_sequential_calls(request, export):
    g = Generator(request.getfixturevalue(export))
    calls = [
        ("The river", dict(max_new_tokens=20, temperature=0.9, seed=1, ignore_eos=True)),
        ("Visitors walk to the", dict(max_new_tokens=14, do_sample=False, ignore_eos=True)),
        ("Children", dict(max_new_tokens=25, top_k=10, seed=2, ignore_eos=True)),
    ]
    refs = [g.generate(prompt, **kw) for prompt, kw in calls]
    results: list[list] = [[] for _ in calls]
    streams = [g.stream(prompt, result=res, **kw) for (prompt, kw), res in zip(calls, results)]
    # a generate() call while the streams are half-way must neither disturb them nor be disturbed
    firsts = [next(s) for s in streams]
    middle = g.generate(*calls[0][:1], **calls[0][1])
    pieces = _round_robin(*streams)
    for ref, first, rest, res in zip(refs, firsts, pieces, results):
        assert first + "".join(rest) == ref.text
        assert res[0].token_ids == ref.token_ids and res[0].finish_reason == ref.finish_reason
    assert middle.token_ids == refs[0].token_ids


def test_abandoned_stream_gives_its_context_back(tiny_export):
    g = Generator(tiny_export)
    kw = dict(max_new_tokens=20, do_sample=False, ignore_eos=True)
    ref = g.generate("The river", **kw)
    s = g.stream("The river", **kw)
    next(s)  # holds g.lm now: the next call needs a second context
    assert g.generate("The river", **kw).token_ids == ref.token_ids
    s.close()
    before = g._pool._created
    for _ in range(3):  # sequential calls reuse the idle contexts: no new ones
        assert g.generate("The river", **kw).token_ids == ref.token_ids
    assert g._pool._created == before == 2
    assert g.lm.cache.allocations == 1  # sequential calls use (and reuse) the primary context


CAPPED = textwrap.dedent(
    """
    import json, sys, threading
    from gpt2edge.runtime import Generator

    g = Generator(sys.argv[1], max_contexts=2)
    kw = dict(max_new_tokens=12, do_sample=False, ignore_eos=True)
    prompts = ["The river", "Visitors walk", "The city at night", "Children learned", "Students arrive"]
    expected = [g.generate(p, **kw).text for p in prompts]
    seen_live, got = [], {}
    start = threading.Barrier(len(prompts))

    def worker(i):
        start.wait()
        got[i] = g.generate(prompts[i], callback=lambda step: seen_live.append(g._pool.live), **kw).text

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"max_live": max(seen_live), "same": [got[i] == expected[i] for i in range(len(prompts))]}))
    """
)


@pytest.mark.parametrize("export", EXPORTS)
def test_max_contexts_caps_the_caches_and_keeps_every_result(request, export):
    """Five threads at once on max_contexts=2: never more than two contexts (KV caches) exist, the others wait,
    and every call still gets its sequential tokens."""
    folder = request.getfixturevalue(export)
    run = subprocess.run([sys.executable, "-c", CAPPED, str(folder)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["max_live"] <= 2 and all(out["same"]), out


def test_a_call_beyond_the_cap_waits_then_says_why(tiny_export):
    """One thread holding the only context in an open stream: a second call cannot get one; with a wait it
    raises a one-line GenerationError instead of hanging, and works again once the stream is closed."""
    g = Generator(tiny_export, max_contexts=1, context_wait_s=0.2)
    stream = g.stream("The river", max_new_tokens=20, ignore_eos=True, do_sample=False)
    next(stream)  # the stream now holds the context
    with pytest.raises(GenerationError, match="max_contexts"):
        g.generate("The city", max_new_tokens=3)
    stream.close()
    assert g.generate("The city", max_new_tokens=3, do_sample=False).token_ids
    assert g._pool.live == 1


@pytest.mark.parametrize(
    "kw", [dict(max_contexts=0), dict(max_contexts=True), dict(max_contexts=1.5), dict(context_wait_s=-1),
           dict(context_wait_s=float("nan")), dict(context_wait_s=float("inf")), dict(context_wait_s="1")],
)  # fmt: skip
def test_bad_caps_are_refused_before_loading(kw, tmp_path):
    """Checked before the folder is even read: an empty folder would otherwise be the error."""
    with pytest.raises(GenerationError, match="max_contexts|context_wait_s"):
        Generator(tmp_path, **kw)
