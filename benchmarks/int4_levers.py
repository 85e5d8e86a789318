"""The int4 recipe's levers, kernel by kernel: MatMulNBits' cost per bits / block size / accuracy level /
zero points, for one decode step (M = 1) and a 128-token prefill (M = 128), on a GPT-2 size's shapes (default small).

    python benchmarks/int4_levers.py [--size small|medium|large|xl] [--threads 2] [--rounds 3] [--repeat 40]
        [--only layers|head] [--json]

Two parts, timed separately: `layers` (n_layer x qkv / proj / fc / fc-proj, the block matmuls) and `head`
(the tied 50,257 x n_embd table, read once per step). Every variant's graph is written once to a temporary folder,
then timed in its own process (ONNX Runtime's spinning thread pools would slow a neighbour), variants
alternating in `--rounds` interleaved rounds, each timing under `flock $BENCH_LOCK` (/tmp/bench.lock) so that
other benchmarks on a shared host do not overlap it. Prints the median and range over the rounds of each
run's median ms, the bytes it reads and the GB/s that makes; and the host's load during the runs. Between
timed runs a 96 MB buffer is written, so that the weights come from memory, as in a whole decode step (a part
alone, e.g. the 40 MB head, would otherwise run partly from the 32 MB last-level cache).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from bench_lock import run_locked

VOCAB = 50257


def block_shapes(c: int) -> list[tuple[int, int]]:
    return [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]  # (K, N): qkv, attn proj, fc, fc proj


FLUSH_BYTES = 96 << 20  # written between timed runs: more than the last-level cache (32 MB here)


@dataclass(frozen=True)
class Variant:
    part: str  # "layers" or "head"
    bits: int  # 4 / 8; 32: fp32 MatMul
    block: int
    level: int  # MatMulNBits accuracy_level
    symmetric: bool
    op: str = "nbits"  # "nbits": MatMulNBits; "dqmm": DynamicQuantizeMatMul (per-column int8, u8s8 GEMM)

    @property
    def name(self) -> str:
        if self.op == "dqmm":
            return f"{self.part} int8 DynamicQuantizeMatMul"
        if self.bits == 32:
            return f"{self.part} fp32"
        zp = "sym" if self.symmetric else "asym"
        return f"{self.part} q{self.bits} b{self.block} L{self.level} {zp}"


def build(v: Variant, path: Path, c: int = 768, layers: int = 12) -> int:
    """Write variant `v`'s graph (width `c`, `layers` blocks) to `path`; returns the bytes its weights take
    (one decode step's read)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from gpt2edge.quantize.primitives import quantize_blockwise
    from gpt2edge.quantize.weight_only import dynamic_int8_node, matmulnbits_node

    rng = np.random.default_rng(0)
    nodes, inits, nbytes = [], [], 0

    def matmul(inp: str, K: int, N: int, name: str) -> str:
        nonlocal nbytes
        w, out = (rng.standard_normal((K, N)) * 0.02).astype(np.float32), f"{name}.y"
        if v.bits == 32:
            inits.append(numpy_helper.from_array(w, f"{name}.w"))
            nodes.append(helper.make_node("MatMul", [inp, f"{name}.w"], [out]))
            nbytes += w.nbytes
            return out
        if v.op == "dqmm":
            node, weights = dynamic_int8_node(name, inp, name, w, out)
            nodes.extend(node)
            inits.extend(weights)
            nbytes += sum(int(np.prod(t.dims)) * (1 if t.data_type == TensorProto.INT8 else 4) for t in weights)
            return out
        q = quantize_blockwise(w, v.bits, v.block, v.symmetric)
        node, weights = matmulnbits_node(name, inp, name, q, out, v.level)
        nodes.extend(node)
        inits.extend(weights)
        nbytes += q.nbytes
        return out

    x, outputs = "x", []
    if v.part == "head":
        outputs.append(matmul(x, c, VOCAB, "head"))
    else:
        shapes = block_shapes(c)
        for layer in range(layers):
            p = f"h{layer}"
            outputs.append(matmul(x, *shapes[0], f"{p}.qkv"))  # kept as an output: ORT computes it
            attn = matmul(x, *shapes[1], f"{p}.proj")
            mlp = matmul(matmul(x, *shapes[2], f"{p}.fc"), *shapes[3], f"{p}.fcproj")
            nodes += [
                helper.make_node("Add", [x, attn], [f"{p}.a"]),
                helper.make_node("Add", [f"{p}.a", mlp], [f"{p}.x"]),
            ]
            x = f"{p}.x"
        outputs.append(x)
    graph = helper.make_graph(
        nodes,
        "levers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", c])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        inits,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    onnx.save_model(helper.make_model(graph, opset_imports=opsets), str(path))
    return nbytes


def time_model(path: str, threads: int, tokens: int, repeat: int) -> list[tuple[float, float]]:
    """In this (fresh) process: (wall ms, CPU ms of the process) of each of `repeat` runs after a warm-up."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    width = sess.get_inputs()[0].shape[1]  # n_embd of the graph built
    x = np.random.default_rng(1).standard_normal((tokens, width)).astype(np.float32)
    flush = np.ones(FLUSH_BYTES // 4, dtype=np.float32)
    for _ in range(max(3, repeat // 10)):
        sess.run(None, {"x": x})
    out = []
    for _ in range(repeat):
        flush += 1.0  # evict the weights from the last-level cache, as a whole decode step does
        t0, c0 = time.perf_counter(), time.process_time()
        sess.run(None, {"x": x})
        out.append(((time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3))
    return out


def timed_run(path: Path, threads: int, tokens: int, repeat: int) -> tuple[dict[str, float], float]:
    """({median, best wall ms, median CPU ms}, other processes' CPU per wall second) of one fresh-process run
    under the bench lock. On a busy host the best run and the CPU time are the less disturbed figures."""
    code = (
        "import json,sys; sys.path.insert(0, sys.argv[5]); from int4_levers import time_model; "
        "print(json.dumps(time_model(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))"
    )
    argv = [sys.executable, "-c", code, str(path), str(threads), str(tokens), str(repeat), str(Path(__file__).parent)]
    out, others = run_locked(argv)
    runs = np.array(json.loads(out))  # (repeat, 2): wall, cpu
    stats = {"ms": float(np.median(runs[:, 0])), "best": float(runs[:, 0].min()), "cpu": float(np.median(runs[:, 1]))}
    return stats, others


def default_variants(only: str | None) -> list[Variant]:
    layers = [Variant("layers", 32, 0, 0, True)]
    layers += [Variant("layers", 4, b, 4, s) for b, s in itertools.product((32, 64, 128), (True, False))]
    layers += [Variant("layers", 4, 32, lv, True) for lv in (0, 1)]
    layers += [Variant("layers", 8, 128, 4, False)]
    head = [Variant("head", 8, b, 4, True) for b in (32, 128)]
    head += [Variant("head", 4, b, 4, True) for b in (32, 64, 128)]
    head += [Variant("head", 4, 32, 4, False), Variant("head", 4, 32, 0, True)]
    return {"layers": layers, "head": head}.get(only, layers + head)


def parse_variant(text: str) -> Variant:
    """'head:4:64:4:sym' -> Variant (part:bits:block:level:sym|asym|dqmm; dqmm: per-column int8
    DynamicQuantizeMatMul, bits 8, block and level unused)."""
    part, bits, block, level, zp = text.split(":")
    return Variant(part, int(bits), int(block), int(level), zp == "sym", "dqmm" if zp == "dqmm" else "nbits")


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median over the rounds of each figure, and the range of the median wall time."""
    out = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    out["ms_lo"], out["ms_hi"] = min(r["ms"] for r in runs), max(r["ms"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("small", "medium", "large", "xl"), default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128], help="rows of x: 1 = decode, 128 = prefill")
    ap.add_argument("--only", choices=("layers", "head"))
    ap.add_argument("--variant", action="append", type=parse_variant, help="part:bits:block:level:sym|asym")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    variants = args.variant or default_variants(args.only)
    results: dict[tuple[Variant, int], list[dict[str, float]]] = {}
    others: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        from gpt2edge.export.random_checkpoint import SIZES

        c, layers = SIZES[args.size]["n_embd"], SIZES[args.size]["n_layer"]
        print(f"shapes: GPT-2 {args.size} (n_embd {c}, {layers} layers)", file=sys.stderr)
        sizes = {v: build(v, Path(tmp) / f"{i}.onnx", c, layers) for i, v in enumerate(variants)}
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]  # rotate who goes first
            for v, tokens in itertools.product(order, args.tokens):
                if tokens > 1 and v.level in (0, 1) and v.bits != 32 and v.op == "nbits":
                    continue  # float-compute levels: decode only
                stats, busy = timed_run(Path(tmp) / f"{variants.index(v)}.onnx", args.threads, tokens, args.repeat)
                results.setdefault((v, tokens), []).append(stats)
                others.append(busy)
                print(f"round {r + 1} {v.name} M={tokens}: {stats} (others {busy:.2f} cpu/s)", file=sys.stderr)
    rows = [
        {**asdict(v), "name": v.name, "tokens": t, "mb": sizes[v] / 1e6, **summarize(results[v, t])}
        for v in variants
        for t in args.tokens
        if (v, t) in results
    ]
    load = {"others_cpu_per_s_median": float(np.median(others)), "others_cpu_per_s_max": float(max(others))}
    if args.json:
        print(json.dumps({"rows": rows, "load": load}, indent=2))
        return
    print("| variant | M | weight MB | wall ms median (range) | best ms | CPU ms | GB/s (best) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['tokens']} | {r['mb']:.1f} | {r['ms']:.3f} ({r['ms_lo']:.3f}-{r['ms_hi']:.3f}) | "
            f"{r['best']:.3f} | {r['cpu']:.3f} | {r['mb'] / r['best']:.1f} |"
        )
    print(
        f"\nother processes' CPU during the runs: median {load['others_cpu_per_s_median']:.2f}, "
        f"max {load['others_cpu_per_s_max']:.2f} cores (of {os.cpu_count()})"
    )


if __name__ == "__main__":
    main()
