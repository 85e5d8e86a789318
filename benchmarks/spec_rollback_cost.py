"""What rolling back rejected draft tokens costs a concat-cache target: a verify step (k = 4, 5 tokens) with
no dead slots and with 64 masked dead slots in its past, one compaction copy, and a plain 1-token step.

    python benchmarks/spec_rollback_cost.py TAIL_CONCAT_DIR [--live 256] [--rounds 5]

Prints one JSON object: per measurement [median, min, max] over the rounds, in ms (each round's figure is the
median of 5 steps). Dead-slot and no-dead-slot rounds alternate.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.lm import OrtLM
from gpt2edge.runtime.speculative.cache import CachedSequence

K = 4


def sequence(folder: ModelFolder, live: int, dead: int, rng: np.random.Generator) -> CachedSequence:
    """A cache holding `live` tokens, `dead` masked slots among them when dead > 0."""
    seq = CachedSequence(OrtLM(folder, threads=2), live + 64, dead_room=dead + 64)
    tokens = rng.integers(0, folder.dims["vocab_size"], live).tolist()
    seq.feed(tokens[: live - dead])
    if dead:
        seq.feed(tokens[live - dead :] + [1] * dead, keep=1)
        seq.truncate(live)  # the last `dead` slots are now rejected drafts
    return seq


def timed(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    fn(*args, **kwargs)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--live", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    folder = ModelFolder.open(args.model_dir, verify=False)
    rng = np.random.default_rng(0)
    res: dict[str, list[float]] = {"verify_0_dead": [], "verify_64_dead": [], "compact": [], "decode_1": []}
    for r in range(args.rounds):
        for dead in (0, 64) if r % 2 == 0 else (64, 0):
            seq = sequence(folder, args.live, dead, rng)
            steps = []
            for _ in range(5):
                steps.append(timed(seq.feed, [5] * (K + 1), keep=K + 1))
                seq.truncate(len(seq.tokens) - K - 1)
                if dead == 0:
                    seq._compact()  # stay free of dead slots (not timed)
            res[f"verify_{dead}_dead"].append(float(np.median(steps)))
        seq = sequence(folder, args.live, 64, rng)
        res["compact"].append(timed(seq._compact))
        res["decode_1"].append(float(np.median([timed(seq.feed, [5]) for _ in range(5)])))
    print(json.dumps({k: [round(float(np.median(v)), 2), round(min(v), 2), round(max(v), 2)] for k, v in res.items()}))


if __name__ == "__main__":
    main()
