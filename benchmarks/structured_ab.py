"""A constrained step's sampling and mask code of another revision against this tree's, in ONE process.

    python benchmarks/structured_ab.py MODEL_DIR --base REV [--rounds 24] [--tokens 96]

A gap of a few percent between two trees run as separate processes drowns in a shared host's drift (the same
tree's plain step moved 1.2 -> 2.1 ms within an hour on a Zen 3 VM). Here REV's sampling.py, top_k.py and
constraints/engine.py are loaded from git beside this tree's, and the generate loop is switched between the two
(row_decoder's next_tokens, rows.py's allowed_masks) round by round, in alternating order, so that both see the
same minutes, the same ONNX Runtime session and the same caches. Per round and variant: the median gap between
tokens of a plain seeded generation and of one per constraint (benchmarks/structured.py's JSON Schema of ten
fields and its regex, temperature 0.8). Prints, per variant, the median over rounds and the constrained gaps'
overhead over that variant's plain one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import structured

import gpt2edge.runtime.constraints.engine as engine
import gpt2edge.runtime.constraints.rows as rows
import gpt2edge.runtime.decoding.row_decoder as row_decoder
import gpt2edge.runtime.decoding.sampling as sampling
from gpt2edge.runtime import Generator

REPO = Path(__file__).resolve().parent.parent


def module_at(rev: str, path: str) -> dict:
    """The namespace of `path` (a gpt2edge module) as revision `rev` wrote it, registered under its own name."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    name = f"ab_{rev}_{Path(path).stem}".replace("-", "_")
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module.__dict__


def base_functions(rev: str) -> tuple:
    """(next_tokens, allowed_masks) of `rev`, each calling that revision's helpers."""
    top_k = module_at(rev, "gpt2edge/runtime/decoding/top_k.py")
    old = module_at(rev, "gpt2edge/runtime/decoding/sampling.py")
    for name in ("scaled_top_k", "apply_top_k", "apply_temperature"):  # imported by name: rebound to rev's
        old[name] = top_k[name]
    old["_take"] = top_k["take"]
    return old["next_tokens"], module_at(rev, "gpt2edge/runtime/constraints/engine.py")["allowed_masks"]


def gap_ms(gen: Generator, constraint, tokens: int, seed: int) -> float:
    stamps: list[float] = []
    gen.generate(
        "The", constraint=constraint, max_new_tokens=tokens, ignore_eos=constraint is None, do_sample=True,
        seed=seed, temperature=0.8, callback=lambda _step: stamps.append(time.perf_counter()),
    )  # fmt: skip
    return statistics.median((b - a) * 1e3 for a, b in zip(stamps, stamps[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--base", required=True, help="the git revision to compare this tree with")
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    variants = {"base": base_functions(args.base), "this tree": (sampling.next_tokens, engine.allowed_masks)}
    kinds = {"plain": None, **structured.CONSTRAINTS}
    gen = Generator(args.model)
    gaps: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (the engine's tokenizer, lexer states)
        order = list(variants) if r % 2 else list(variants)[::-1]
        for v in order:
            row_decoder.next_tokens, rows.allowed_masks = variants[v]
            for kind, c in kinds.items():
                ms = gap_ms(gen, c, args.tokens, r)
                if r:
                    gaps.setdefault((v, kind), []).append(ms)
    for v in variants:
        plain = statistics.median(gaps[(v, "plain")])
        cells = [f"plain {plain:.3f} ms"]
        for kind in structured.CONSTRAINTS:
            g = statistics.median(gaps[(v, kind)])
            cells.append(f"{kind} {g:.3f} ms ({100 * (g / plain - 1):+.1f} %)")
        print(f"{v:>10}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
