"""Rows that do not depend on the traffic: does a served request get the numbers it gets alone, and what does
--deterministic cost?

check: each folder's mixed traffic (requests of different lengths, greedy and seeded sampling, all submitted
at once to a continuous scheduler) against each request served alone by the same scheduler; prints per mode
(default, --deterministic) how many requests changed a token, how many changed any log-prob bit, and the
largest log-prob difference (over the whole next-token distribution of every step both runs made).

speed: tokens/s of the continuous scheduler at 1, 4 and 16 concurrent greedy rows, default against
--deterministic, interleaved rounds (median and range).

  python benchmarks/determinism.py check FOLDER...            # e.g. ../shared trained model's int8 / int4
  python benchmarks/determinism.py speed FOLDER [--rounds 3] [--tokens 64]
  python benchmarks/determinism.py kernels FOLDER...          # batch size and left pad, one row against alone
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from gpt2edge.runtime import Generator
from gpt2edge.serve import ServeConfig
from gpt2edge.serve.scheduling.continuous import ContinuousScheduler
from gpt2edge.serve.scheduling.jobs import Job, Sampling

PROMPTS = [
    "def main():\n    ",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "#",
    "for i in range(10):",
    "The river rose and the",
    "    return [x for x in items if x is not None]\n\ndef parse(text):\n    '''Parse the",
]


def traffic() -> list[tuple[str, int, dict]]:
    """(prompt, max_tokens, sampling) per request: greedy and seeded rows of different lengths."""
    out = []
    for i, p in enumerate(PROMPTS):
        sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=1.0, top_p=0.95, seed=100 + i)
        out.append((p, 12 + 5 * (i % 3), sampling))
    return out


def make_job(gen: Generator, prompt: str, max_tokens: int, sampling: dict) -> Job:
    """One request of one row, its prompt already encoded."""
    ids = gen.tokenizer.encode(prompt) or [int(gen.bos_token_id)]
    return Job([prompt], [len(ids)], 1, max_tokens, Sampling(**sampling), (), lambda e: None, gen.tokenizer,
               prompt_ids=[ids])  # fmt: skip


def serve(gen: Generator, specs, deterministic: bool, max_batch: int = 8) -> dict[int, tuple[list, list]]:
    """Submit every request at once; returns {request index: (tokens, (1, W) log-prob rows)}."""
    sched = ContinuousScheduler(gen, ServeConfig(model_name="m", max_batch=max_batch, deterministic=deterministic))
    seen: dict[int, tuple[list, list]] = {}
    index: dict[int, int] = {}
    take = sched._take

    def spy(live, i, token, scores):  # every token a row takes, with the distribution it was chosen from
        toks, lps = seen.setdefault(index[live.job.id], ([], []))
        toks.append(token)
        lps.append(np.array(scores, copy=True))
        take(live, i, token, scores)

    sched._take = spy
    jobs = []
    for k, (prompt, m, sampling) in specs:
        jobs.append(make_job(gen, prompt, m, sampling))
        index[jobs[-1].id] = k
    for j in jobs:
        sched.submit(j)
    sched.start()
    deadline = time.monotonic() + 300
    while not all(j.finished for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.002)
    serve.path = "aligned batch" if sched.align else type(sched.slots).__name__
    serve.path += f" ({sched.align})" if sched.align else ""
    sched.stop()
    return seen


def compare(gen: Generator, deterministic: bool) -> tuple[int, int, float]:
    """(requests with another token, requests with another log-prob bit, largest |difference|)."""
    specs = list(enumerate(traffic()))
    mixed = serve(gen, specs, deterministic)
    tok = bits = 0
    worst = 0.0
    for k, spec in specs:
        alone = serve(gen, [(k, spec)], deterministic)[k]
        got = mixed[k]
        tok += got[0] != alone[0]
        n = min(len(got[1]), len(alone[1]))
        split = [a != b for a, b in zip(got[0], alone[0])]
        n = split.index(True) + 1 if True in split else n  # after another token the contexts differ: not compared
        diffs = [np.abs(a - b).max() for a, b in zip(got[1][:n], alone[1][:n])]
        same_bits = all(np.array_equal(a, b) for a, b in zip(got[1][:n], alone[1][:n])) and got[0] == alone[0]
        bits += not same_bits
        worst = max(worst, max(diffs, default=0.0))
    return tok, bits, worst


def check(folders: list[str]) -> None:
    print("| folder | mode | rows run as | requests | other token | other log-prob bits | largest diff (nats) |")
    print("|---|---|---|---|---|---|---|")
    for f in folders:
        gen = Generator(f, spin=False)
        for det in (False, True):
            tok, bits, worst = compare(gen, det)
            mode = "--deterministic" if det else "default"
            print(f"| {f} | {mode} | {serve.path} | {len(PROMPTS)} | {tok} | {bits} | {worst:.2e} |", flush=True)


def speed(folder: str, rounds: int, tokens: int, rows: list[int]) -> None:
    gen = Generator(folder, spin=False)
    gen.generate("warm-up", max_new_tokens=4)  # the session's first runs are slower: not inside round 1's A
    results: dict[tuple[int, bool], list[float]] = {}
    ttft: dict[tuple[int, bool], list[float]] = {}  # each round's median time to a row's first token (ms)
    for _ in range(rounds):
        for n in rows:
            for det in (False, True):  # interleaved: A B A B
                sched = ContinuousScheduler(gen, ServeConfig(model_name="m", max_batch=n, deterministic=det))
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
                jobs = [make_job(gen, p, tokens, dict(temperature=0, ignore_eos=True)) for p in prompts]
                first: dict[int, float] = {}
                for j in jobs:  # the time of each row's first event (its first token)
                    j.emit = lambda e, k=j.id, seen=first: seen.setdefault(k, time.perf_counter())
                t0 = time.perf_counter()
                for j in jobs:
                    sched.submit(j)
                sched.start()
                while not all(j.finished for j in jobs):
                    time.sleep(0.001)
                dt = time.perf_counter() - t0
                sched.stop()
                results.setdefault((n, det), []).append(n * tokens / dt)
                ttft.setdefault((n, det), []).append(statistics.median(first.values()) * 1e3 - t0 * 1e3)
    print(f"{folder}: {rounds} rounds, {tokens} tokens per row, tokens/s median (range)")
    print("| rows | default | --deterministic | cost | first token ms, default | --deterministic |")
    print("|---|---|---|---|---|---|")
    for n in rows:
        a, b = results[(n, False)], results[(n, True)]
        ma, mb = statistics.median(a), statistics.median(b)
        fa, fb = statistics.median(ttft[(n, False)]), statistics.median(ttft[(n, True)])
        print(f"| {n} | {ma:.0f} ({min(a):.0f}-{max(a):.0f}) | {mb:.0f} ({min(b):.0f}-{max(b):.0f}) | "
              f"{ma / mb:.2f}x | {fa:.0f} | {fb:.0f} |", flush=True)  # fmt: skip


def kernels(folder: str, length: int = 37) -> None:
    """Which knob moves a row's numbers: one row of `length` tokens alone (B = 1, no pad) against the same row in a
    batch of B rows (the others random prompts) with `pad` slots of left padding; the largest log-prob difference
    after the prefill and after one decode step."""
    from gpt2edge.runtime.model.positions import left_pad, position_ids_from_mask

    gen = Generator(folder, spin=False)
    rng, vocab = np.random.default_rng(0), min(1000, int(gen.graph.vocab_size))
    row = rng.integers(0, vocab, length).tolist()

    def run(B: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
        prompts = [row] + [rng.integers(0, vocab, length + pad).tolist() for _ in range(B - 1)]
        S = length + pad
        lm = gen.graph.new_lm()
        lm.start(B, S + 1)
        ids, mask = left_pad(prompts, gen.pad_token_id, S + 1)
        a = lm.forward(ids, mask[:, :S], position_ids_from_mask(mask[:, :S], S))[0].copy()
        mask[:, S] = 1  # the decode step's own token
        nxt = np.full((B, 1), 11, dtype=np.int64)
        pos = position_ids_from_mask(mask, S + 1)[:, -1:]
        b = lm.forward(nxt, mask, pos)[0].copy()
        return a, b

    ref = run(1, 0)
    print(f"{folder}: a row of {length} tokens, alone vs in a batch; largest |log-prob difference| (prefill, decode)")
    print("| rows | " + " | ".join(f"pad {p}" for p in (0, 1, 3, 8, 13, 16, 24, 32)) + " |")
    print("|---|" + "---|" * 8)
    for B in (1, 2, 4, 8):
        cells = []
        for pad in (0, 1, 3, 8, 13, 16, 24, 32):
            if B == 1 and pad:
                cells.append("")
                continue
            got = run(B, pad)
            cells.append("/".join(f"{np.abs(g - r).max():.0e}" if not np.array_equal(g, r) else "0"
                                  for g, r in zip(got, ref)))  # fmt: skip
        print(f"| {B} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("folders", nargs="+")
    s = sub.add_parser("speed")
    s.add_argument("folder")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--tokens", type=int, default=64)
    s.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    k = sub.add_parser("kernels")
    k.add_argument("folders", nargs="+")
    a = ap.parse_args()
    if a.cmd == "kernels":
        for f in a.folders:
            kernels(f)
    elif a.cmd == "check":
        check(a.folders)
    else:
        speed(a.folder, a.rounds, a.tokens, a.rows)


if __name__ == "__main__":
    main()
