"""The prefix cache: time to first token and tokens/s with and without it, on chats under one system prompt.

    python benchmarks/prefix_cache.py MODEL_DIR [--clients 1 16 64] [--turns 2] [--system-tokens 512]
        [--user-tokens 24] [--answer-tokens 8] [--cache-bytes 1G] [--rounds 1] [--json]
    python benchmarks/prefix_cache.py --make DIR ...   # first a random GPT-2 small-shape checkpoint, exported to DIR

Each client is one chat: its first prompt is the shared system prompt (--system-tokens) and a user turn of its
own (--user-tokens); each later turn resends the whole history (the system prompt, every user turn and answer so
far) and a new user turn, as chat clients do. Every answer is greedy with ignore_eos (--answer-tokens each).
At each level, c clients run their chats at once (closed loop: a client sends its next turn when its answer
ends) on the continuous scheduler in this process (gpt2edge.serve.scheduling.continuous, the server's own, with
its default --prefill-tokens; no HTTP, so the figures are the scheduler's and the model's), first without the
prefix cache, then with --cache-bytes of it, each on a fresh scheduler and cache (the first request of a level
pays the system prompt), round after round, under flock /tmp/bench.lock.

Per level and mode: time to first token p50/p90 (submit -> first token), completion tokens/s (all clients'
tokens / the level's wall time), prompt tokens the cache supplied, and whether every answer's token ids equal
the run without the cache (greedy: the chats' later prompts hold the answers, so one different token would
change every later turn). Then the max |difference| of the first token's log-probs between a full prefill and a
prefill of the suffix on the cached prefix, for one chat's last prompt.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import threading
import time

import numpy as np

from gpt2edge.budget.memory import parse_size
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.prefix_cache import PrefixCache
from gpt2edge.runtime.model.slots import SlotLM
from gpt2edge.sample_text import SAMPLE_TEXT
from gpt2edge.serve import ServeConfig
from gpt2edge.serve.scheduling.continuous import ContinuousScheduler
from gpt2edge.serve.scheduling.jobs import Job, Piece, Sampling

LOCK = os.environ.get("BENCH_LOCK", "/tmp/bench.lock")


def corpus(gen: Generator, n: int) -> list[int]:
    """n token ids of the sample text (repeated as needed)."""
    ids = gen.tokenizer.encode(SAMPLE_TEXT)
    return (ids * (n // len(ids) + 1))[:n]


class Chat:
    """One client's conversation: the system prompt, then user turns and the model's answers."""

    def __init__(self, system: list[int], users: list[list[int]]) -> None:
        self.history, self.users = list(system), users
        self.answers: list[list[int]] = []

    def prompt(self, turn: int) -> list[int]:
        return self.history + self.users[turn]


def one_turn(scheduler: ContinuousScheduler, gen: Generator, ids: list[int], max_tokens: int) -> dict:
    """Submit one greedy request and wait for it: its time to first token, latency, token ids, cached tokens."""
    first, done = [], threading.Event()

    def emit(event) -> None:
        if not first:
            first.append(time.perf_counter())
        if not isinstance(event, Piece) or event.finish_reason is not None:
            done.set()

    job = Job([""], [len(ids)], 1, max_tokens, Sampling(temperature=0, ignore_eos=True), (), emit, gen.tokenizer,
              prompt_ids=[ids])  # fmt: skip
    t0 = time.perf_counter()
    scheduler.submit(job)
    done.wait()
    return {"ttft": first[0] - t0, "latency": time.perf_counter() - t0, "tokens": list(job.rows[0].decoder.generated),
            "cached": job.cached_tokens, "prompt": len(ids)}  # fmt: skip


def run_level(gen: Generator, chats: list[Chat], turns: int, answer: int, cache_bytes: int) -> dict:
    config = ServeConfig(model_name="bench", max_batch=64, prefix_cache_bytes=cache_bytes)
    scheduler = ContinuousScheduler(gen, config)
    scheduler.start()
    results: list[list[dict]] = [[] for _ in chats]

    def client(i: int) -> None:
        chat = chats[i]
        for t in range(turns):
            r = one_turn(scheduler, gen, chat.prompt(t), answer)
            results[i].append(r)
            chat.history = chat.prompt(t) + r["tokens"]  # the next turn resends the answer too

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(chats))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    scheduler.stop()
    flat = [r for rs in results for r in rs]
    ttft = np.array([r["ttft"] for r in flat]) * 1e3
    return {
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "tokens_per_s": sum(len(r["tokens"]) for r in flat) / wall,
        "prompt_tokens": sum(r["prompt"] for r in flat),
        "cached_tokens": sum(r["cached"] for r in flat),
        "wall_s": wall,
        "answers": [[r["tokens"] for r in rs] for rs in results],
    }


def logprob_gap(gen: Generator, ids: list[int]) -> float:
    """Max |difference| of the next-token log-probs after ids: a full prefill vs the suffix on its cached prefix."""
    slot = SlotLM(gen.graph, 1)
    cache = PrefixCache.for_graph(slot.graph, 1 << 30)
    full = slot.join([ids], gen.pad_token_id)[0].copy()
    cache.insert(ids, slot.row_kv(0))
    slot.free(0)
    blocks = cache.lookup(ids, len(ids) - 1)
    cached = slot.join([ids], gen.pad_token_id, [blocks])[0]
    return float(np.abs(full - cached).max())


def make(out: str) -> str:
    from gpt2edge.export import export_model, make_random_checkpoint

    ckpt = make_random_checkpoint(out + "-ckpt", size="small", seed=0)
    export_model(str(ckpt), out, kv_cache="shared")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--make", help="export a random GPT-2 small-shape checkpoint to this folder and use it")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=24)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--cache-bytes", default="1G")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    folder = make(args.make) if args.make else args.model_dir
    if folder is None:
        ap.error("give MODEL_DIR or --make DIR")
    gen = Generator(folder, threads=args.threads, spin=False)
    words = corpus(gen, args.system_tokens + 64 * args.turns * args.user_tokens + 7)
    system = words[: args.system_tokens]
    rows = []
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for rnd in range(args.rounds):
            for c in args.clients:
                level = {}
                for name, nbytes in (("off", 0), ("on", parse_size(args.cache_bytes))):
                    chats = []
                    for i in range(c):  # each client's user turns: its own windows of the text
                        at = args.system_tokens + 7 + i * args.turns * args.user_tokens
                        users = [words[at + t * args.user_tokens :][: args.user_tokens] for t in range(args.turns)]
                        chats.append(Chat(system, users))
                    level[name] = run_level(gen, chats, args.turns, args.answer_tokens, nbytes)
                same = level["on"]["answers"] == level["off"]["answers"]
                for name in ("off", "on"):
                    r = {k: v for k, v in level[name].items() if k != "answers"}
                    rows.append({"round": rnd, "clients": c, "cache": name, "same_ids": same, **r})
                    print(f"round {rnd} clients {c:3d} cache {name:3s}: TTFT p50 {r['ttft_p50_ms']:8.0f} ms  "
                          f"p90 {r['ttft_p90_ms']:8.0f} ms  {r['tokens_per_s']:7.1f} tok/s  cached "
                          f"{r['cached_tokens']:6d} of {r['prompt_tokens']:6d} prompt tokens  "
                          f"wall {r['wall_s']:6.1f} s  "
                          f"same ids: {same}",
                          flush=True)  # fmt: skip
        last = chats[0].history[:-1]
        gap = logprob_gap(gen, last)
    print(f"log-prob gap, full prefill vs cached prefix + suffix ({len(last)} tokens): {gap:.3g}")
    if args.json:
        print(json.dumps({"levels": rows, "logprob_gap": gap}))


if __name__ == "__main__":
    main()
