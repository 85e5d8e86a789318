"""Where speculative greedy decoding of a target splits from its plain greedy decoding, and how close to a tie.

    python benchmarks/spec_split.py TARGET [--prompt-lookup N | --draft DIR] [--text FILE ...]

For each prompt (the first --prompt-len tokens of each --text file; defaults: the three code prompts of
speculative_quantized.sh), both decodings run --new-tokens greedy tokens (EOS ignored); the first differing
token is reported with the top-two log-prob gap of plain decoding at that step (prefill, then one token per
forward, as plain decoding computed it). A split with a gap under 0.1 nats is the near-tie rule of
docs/speculative.md (int8 activations); a wider one would be a bug.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from gpt2edge.bench.speculative import _run, text_prompts
from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.generator import Generator

TEXTS = [
    "gpt2edge/runtime/decoding/generate.py",
    "gpt2edge/runtime/decoding/sampling.py",
    "gpt2edge/runtime/model/kv_cache.py",
]


def plain_gap(gen: Generator, prompt: list[int], tokens: list[int]) -> float:
    """Top-two gap of plain decoding's log-probs after prompt + tokens (prefill, then one token per forward)."""
    lm = gen.lm
    seq = prompt + tokens
    lm.start(1, len(seq))
    out = lm.forward(np.asarray([prompt]), np.ones((1, len(prompt)), np.int64), np.arange(len(prompt))[None])
    for t in range(len(prompt), len(seq)):
        out = lm.forward(np.asarray([[seq[t]]]), np.ones((1, t + 1), np.int64), np.array([[t]]))
    top = np.sort(np.array(out[0]))[-2:]
    return float(top[1] - top[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target", type=Path)
    ap.add_argument("--prompt-lookup", type=int, help="n-gram length (default 3 when no --draft)")
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--text", type=Path, action="append")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=120)
    a = ap.parse_args()
    if a.draft is not None:
        gen = Generator(a.target, draft=a.draft)
    else:
        gen = Generator(a.target, prompt_lookup=a.prompt_lookup or 3)
    texts = tuple(a.text or [Path(t) for t in TEXTS])
    params = SamplingParams(max_new_tokens=a.new_tokens, seed=0)
    for path, prompt in zip(texts, text_prompts(gen, texts, a.prompt_len)):
        plain = _run(gen, prompt, params, "plain").generated[0]
        spec = _run(gen, prompt, params, "spec").generated[0]
        row: dict = {"prompt": str(path), "identical": plain == spec}
        if plain != spec:
            i = next(j for j, (x, y) in enumerate(zip(plain, spec)) if x != y)
            row.update(
                split_at=i, plain=plain[i], speculative=spec[i], plain_top2_gap=plain_gap(gen, prompt, plain[:i])
            )
        print(json.dumps(row))


if __name__ == "__main__":
    main()
