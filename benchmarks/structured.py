"""What a constraint costs per token next to a plain decode step, and how long a grammar takes to compile.

    python benchmarks/structured.py MODEL_DIR [MODEL_DIR ...] [--tokens 96] [--rounds 5] [--json OUT]

Per folder and constraint (a JSON Schema of ten fields, a regex): a seeded constrained generation at batch 1
gives a token sequence (its wall time per token after the prefill, next to a plain generation's: the end-to-end
cost, with the mask computed during the forward); each round replays it through a fresh matcher and times, per
token, the mask (the engine's bitmask unpacked to a (V,) bool row), applying it (sampling a seeded (1, V) score row
under the mask, less sampling it unmasked: negative where the allowed tokens are cheaper to sample than the whole
row) and advancing the matcher. The decode step is the median forward of a plain (unconstrained)
generation of the same length.
*gap*: the median wall time between consecutive tokens of a seeded generation (temperature 0.8), constrained
and plain runs interleaved round by round after a warm-up round; *vs plain* beside it is the steadier end-to-end
figure on a busy host (the mean per token, *e2e/tok*, takes every stray slow step in full).
Also: the mask of 16 rows at once (several sequences: the engine's parallel executor), the tokenizer's one-off
conversion, and the compile time of each constraint with the cache cleared. Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from gpt2edge.runtime import Generator
from gpt2edge.runtime.constraints import Constraint, engine
from gpt2edge.runtime.constraints.engine import allowed_masks, compile_constraint
from gpt2edge.runtime.decoding.sampling import next_tokens

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "active": {"type": "boolean"},
        "score": {"type": "integer", "minimum": -100, "maximum": 100},
        "country": {"enum": ["US", "FR", "DE", "JP", "IN", "BR"]},
        "city": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["id", "name", "email", "age", "active", "score", "country", "city", "tags", "zip"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}: [A-Za-z ,.]{1,200}"
CONSTRAINTS = {"json_schema_10_fields": Constraint.json_schema(SCHEMA), "regex": Constraint.regex(REGEX)}


def per_token(gen: Generator, compiled, tokens: list[int]) -> dict[str, float]:
    """Median ms per token of mask, apply and advance while replaying `tokens` (one round)."""
    m = compiled.matcher()
    V = gen.graph.vocab_size
    rng = np.random.default_rng(0)
    row = (rng.standard_normal((1, V)) * 3).astype(np.float32)  # a spread-out (1, V) score row
    row -= np.log(np.exp(row).sum(dtype=np.float64)).astype(np.float32)
    params = gen.sampling_params(max_new_tokens=len(tokens), do_sample=True, temperature=0.8)
    seen = [np.zeros(1, dtype=np.int64)]
    mask_ms, apply_ms, advance_ms = [], [], []
    for t in tokens:
        t0 = time.perf_counter()
        allowed = allowed_masks([m], gen.eos_token_id)
        t1 = time.perf_counter()
        next_tokens(row, params, seen, 1, rng, allowed=allowed)  # the masked row's processing and draw
        t2 = time.perf_counter()
        next_tokens(row, params, seen, 1, rng)  # the same row's, unmasked
        t3 = time.perf_counter()
        if t in gen.eos_token_id:
            break
        m.advance(t)
        t4 = time.perf_counter()
        mask_ms.append((t1 - t0) * 1e3)
        apply_ms.append(((t2 - t1) - (t3 - t2)) * 1e3)
        advance_ms.append((t4 - t3) * 1e3)
    return {
        "mask_ms": statistics.median(mask_ms),
        "apply_ms": statistics.median(apply_ms),
        "advance_ms": statistics.median(advance_ms),
    }


def rows16(gen: Generator, compiled, tokens: list[int]) -> float:
    """Median ms of one mask step for 16 rows at once (each row at the same position of `tokens`)."""
    ms = [compiled.matcher() for _ in range(16)]
    out = []
    for t in tokens:
        t0 = time.perf_counter()
        allowed_masks(ms, gen.eos_token_id)
        out.append((time.perf_counter() - t0) * 1e3)
        if t in gen.eos_token_id:
            break
        for m in ms:
            m.advance(t)
    return statistics.median(out)


def step_ms(timings: dict, n_tokens: int) -> float:
    """Wall ms per generated token after the prefill: forward, sampling, mask and the loop's own work."""
    return (timings["wall_ms"] - timings["prefill_ms"]) / max(1, n_tokens - 1)


def token_gap(gen: Generator, n_tokens: int, seed: int, constraint: Constraint | None) -> float:
    """The median wall time between consecutive tokens of one seeded generation (forward, mask, sampling and the
    loop's own work of one step; robust to a stray slow step on a busy host, where the mean is not). A plain
    generation (constraint None) runs to n_tokens."""
    stamps: list[float] = []
    gen.generate(
        "The", constraint=constraint, max_new_tokens=n_tokens, ignore_eos=constraint is None, do_sample=True,
        seed=seed, temperature=0.8, callback=lambda _step: stamps.append(time.perf_counter()),
    )  # fmt: skip
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps) if gaps else 0.0


def interleaved_gaps(gen: Generator, n_tokens: int, rounds: int) -> dict[str, list[float]]:
    """token_gap of a plain generation and of each constraint, interleaved round by round (so that a slow spell
    of the host falls on all of them), after one warm-up round that is not counted."""
    kinds = {"plain": None, **CONSTRAINTS}
    gaps: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds + 1):
        for name, c in kinds.items():
            gap = token_gap(gen, n_tokens, r, c)
            if r:
                gaps[name].append(gap)
    return gaps


def bench(folder: str, n_tokens: int, rounds: int) -> dict:
    gen = Generator(folder)
    t0 = time.perf_counter()
    engine.engine_tokenizer(gen.tokenizer, gen.eos_token_id)
    out: dict = {"folder": folder, "vocab": gen.graph.vocab_size, "tokenizer_ms": (time.perf_counter() - t0) * 1e3}
    gaps = interleaved_gaps(gen, n_tokens, rounds)
    out["plain_gap_ms"] = statistics.median(gaps["plain"])
    plain = [
        gen.generate("The", max_new_tokens=n_tokens, ignore_eos=True, do_sample=True, seed=r).timings
        for r in range(rounds)
    ]
    out["decode_step_ms"] = statistics.median(t["decode_ms_per_token_median"] for t in plain)
    out["plain_ms_per_token"] = statistics.median(step_ms(t, n_tokens) for t in plain)
    for name, c in CONSTRAINTS.items():
        compile_ms = []
        for _ in range(rounds):
            engine._cache.clear()  # a cold compile each round (the tokenizer stays converted)
            t0 = time.perf_counter()
            compiled = compile_constraint(c, gen.tokenizer, gen.graph.vocab_size, gen.eos_token_id)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        runs = [
            gen.generate("The", constraint=c, max_new_tokens=n_tokens, do_sample=True, seed=0, temperature=0.8)
            for _ in range(rounds)
        ]
        r = runs[0]
        e2e = statistics.median(step_ms(x.timings, len(x.token_ids)) for x in runs)
        gap = statistics.median(gaps[name])
        rounds_ = [per_token(gen, compiled, r.token_ids) for _ in range(rounds)]
        stats = {k: statistics.median(x[k] for x in rounds_) for k in rounds_[0]}
        total = stats["mask_ms"] + stats["apply_ms"] + stats["advance_ms"]
        out[name] = {
            "compile_ms": statistics.median(compile_ms),
            "tokens": len(r.token_ids),
            "finish": r.finish_reason,
            **stats,
            "total_ms": total,
            "overhead_pct": 100 * total / out["decode_step_ms"],
            "mask_16_rows_ms": statistics.median(rows16(gen, compiled, r.token_ids) for _ in range(rounds)),
            "e2e_ms_per_token": e2e,
            "e2e_overhead_pct": 100 * (e2e / out["plain_ms_per_token"] - 1),
            "gap_ms": gap,
            "gap_range_ms": [min(gaps[name]), max(gaps[name])],
            "gap_overhead_pct": 100 * (gap / out["plain_gap_ms"] - 1),
        }
    return out


SMALL_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
]


def validate(folder: str, per_schema: int) -> dict:
    """Seeded samples of each schema (SCHEMA and SMALL_SCHEMAS), 50 rows a call: how many finished, parsed and
    validated with jsonschema (a "length" finish is counted apart: it ran out of tokens inside the structure)."""
    import jsonschema

    gen = Generator(folder)
    out = {"folder": folder, "samples": 0, "valid": 0, "length": 0, "invalid": 0}
    for i, schema in enumerate([SCHEMA, *SMALL_SCHEMAS]):
        c = Constraint.json_schema(schema)
        for seed in range(-(-per_schema // 50)):
            kw = dict(do_sample=True, seed=1000 * i + seed, num_return_sequences=50, max_new_tokens=192)
            for r in gen.generate("Here is the record as JSON:", constraint=c, **kw):
                out["samples"] += 1
                if r.finish_reason == "length":
                    out["length"] += 1
                    continue
                try:
                    jsonschema.validate(json.loads(r.text), schema)
                    out["valid"] += 1
                except (ValueError, jsonschema.ValidationError):
                    out["invalid"] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--validate", type=int, default=0, metavar="N", help="only: N seeded samples per schema")
    args = ap.parse_args()
    if args.validate:
        for f in args.folders:
            print(json.dumps(validate(f, args.validate)))
        return
    results = [bench(f, args.tokens, args.rounds) for f in args.folders]
    print(f"{'folder':<28} {'constraint':<22} {'compile':>9} {'mask':>7} {'apply':>7} {'advance':>8} "
          f"{'total':>7} {'decode':>7} {'overhead':>8} {'16 rows':>8} {'e2e/tok':>8} {'vs plain':>8} "
          f"{'gap':>7} {'vs plain':>8}")  # fmt: skip
    for r in results:
        for name in CONSTRAINTS:
            c = r[name]
            print(
                f"{r['folder'][-28:]:<28} {name:<22} {c['compile_ms']:>7.1f}ms {c['mask_ms']:>5.3f}ms "
                f"{c['apply_ms']:>5.3f}ms {c['advance_ms']:>6.3f}ms {c['total_ms']:>5.3f}ms "
                f"{r['decode_step_ms']:>5.2f}ms {c['overhead_pct']:>7.1f}% {c['mask_16_rows_ms']:>6.3f}ms "
                f"{c['e2e_ms_per_token']:>6.2f}ms {c['e2e_overhead_pct']:>+7.1f}% "
                f"{c['gap_ms']:>5.3f}ms {c['gap_overhead_pct']:>+7.1f}%"
            )
        print(f"{'':<28} plain generation: median gap between tokens {r['plain_gap_ms']:.3f} ms")
        print(f"{'':<28} tokenizer conversion (once per folder): {r['tokenizer_ms']:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
