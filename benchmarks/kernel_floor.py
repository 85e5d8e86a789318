"""What the matmul kernels alone cost: one decode step's weight matmuls, without the rest of the model.

    python benchmarks/kernel_floor.py [--threads 2] [--repeat 30] [--json]

For each precision gpt2edge ships (fp32 MatMul; int8 and int4 MatMulNBits with the default recipes), builds a
graph of exactly the matmuls one GPT-2 small decode step runs (12 x qkv / proj / fc / fc-proj, and the tied
LM head over 50,257 rows) with seeded random weights, runs it at batch 1 in a fresh process (ONNX Runtime
thread pools of separate sessions spin and would slow each other), and prints its median ms next to the
read-bandwidth probe taken in the same process. `x floor` is kernel ms / (weight bytes / probe bandwidth):
the part of a model's `decode_vs_floor` that the matmul kernels alone account for, before attention, norms,
GELU and node dispatch are added. `x fp32-GEMV bytes/s` divides by the rate the fp32 matmuls stream at
instead (a pure weight stream, often faster than the NumPy probe): the stricter reference. Last, the fp32
block matmuls of a 128-token prefill against the matmul probe: the same split for the prefill's FLOP floor.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np

C, LAYERS, VOCAB = 768, 12, 50257
BLOCK_SHAPES = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]  # (K, N): qkv, attn proj, fc, fc proj
PRECISIONS = ("fp32", "int8", "int4")  # int8/int4 with the default recipes of `gpt2edge quantize`


def _weight(rng: np.random.Generator, K: int, N: int) -> np.ndarray:
    return (rng.standard_normal((K, N)) * 0.02).astype(np.float32)


def build_graph(precision: str, head: bool = True):
    """(model bytes, ONNX model) of one decode step's weight matmuls at `precision` (rows of x: tokens)."""
    from onnx import TensorProto, helper, numpy_helper

    from gpt2edge.quantize import make_recipe
    from gpt2edge.quantize.primitives import quantize_blockwise
    from gpt2edge.quantize.weight_only import matmulnbits_node

    recipe = None if precision == "fp32" else make_recipe(precision)
    rng = np.random.default_rng(0)
    nodes, inits, nbytes = [], [], 0

    def matmul(inp: str, K: int, N: int, name: str, head: bool = False) -> str:
        nonlocal nbytes
        w, out = _weight(rng, K, N), f"{name}.y"
        if recipe is None:
            inits.append(numpy_helper.from_array(w, f"{name}.w"))
            nodes.append(helper.make_node("MatMul", [inp, f"{name}.w"], [out]))
            nbytes += w.nbytes
            return out
        bits = recipe.head_bits if head else recipe.weight_bits
        block = recipe.head_block_size if head else recipe.block_size
        q = quantize_blockwise(w, bits, block, recipe.symmetric)
        node, weights = matmulnbits_node(name, inp, name, q, out, recipe.accuracy_level)
        nodes.extend(node)
        inits.extend(weights)
        nbytes += q.nbytes
        return out

    x = "x"
    for layer in range(LAYERS):
        p = f"h{layer}"
        matmul(x, *BLOCK_SHAPES[0], f"{p}.qkv")
        attn = matmul(x, *BLOCK_SHAPES[1], f"{p}.proj")
        mlp = matmul(matmul(x, *BLOCK_SHAPES[2], f"{p}.fc"), *BLOCK_SHAPES[3], f"{p}.fcproj")
        # keep every layer on the path to the output (the qkv result is unused, as ORT still computes it)
        nodes += [
            helper.make_node("Add", [x, attn], [f"{p}.a"]),
            helper.make_node("Add", [f"{p}.a", mlp], [f"{p}.x"]),
        ]
        x = f"{p}.x"
    outputs = ([matmul(x, C, VOCAB, "head", head=True)] if head else [x]) + [f"h{i}.qkv.y" for i in range(LAYERS)]
    graph = helper.make_graph(
        nodes,
        "decode_matmuls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", C])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        inits,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return nbytes, helper.make_model(graph, opset_imports=opsets)


def _timed_runs(model, threads: int, x: np.ndarray, repeat: int, warmup: int) -> list[float]:
    """Seconds of each of `repeat` runs of `model` on `x` after `warmup` untimed ones."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    for _ in range(warmup):
        sess.run(None, {"x": x})
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, {"x": x})
        times.append(time.perf_counter() - t0)
    return times


def measure(precision: str, threads: int, repeat: int) -> dict:
    """Runs in its own process: the kernel chain's step ms and the bandwidth probe around it."""
    from gpt2edge.bench.probe import read_bandwidth_gbs

    nbytes, model = build_graph(precision)
    x = np.random.default_rng(1).standard_normal((1, C)).astype(np.float32)
    probes = [read_bandwidth_gbs(threads)]
    times = _timed_runs(model, threads, x, repeat, warmup=3)
    probes.append(read_bandwidth_gbs(threads))
    ms = float(np.median(times)) * 1e3
    bandwidth = max(probes)  # the stricter floor, as `gpt2edge bench` takes it
    floor_ms = nbytes / (bandwidth * 1e9) * 1e3
    return {
        "precision": precision,
        "weight_mb": nbytes / 1e6,
        "kernel_ms": ms,
        "kernel_ms_best": min(times) * 1e3,
        "kernel_gbs": nbytes / (ms / 1e3) / 1e9,
        "probe_gbs": bandwidth,
        "floor_ms": floor_ms,
        "kernel_vs_floor": ms / floor_ms,
    }


def measure_prefill(threads: int, repeat: int, tokens: int = 128) -> dict:
    """Runs in its own process: the fp32 block matmuls of a `tokens`-token prefill (the head runs on the last
    position only and is left out) against the matmul probe `gpt2edge bench` uses."""
    from gpt2edge.bench.probe import matmul_gflops

    _, model = build_graph("fp32", head=False)
    flops = 2 * tokens * LAYERS * sum(K * N for K, N in BLOCK_SHAPES)
    x = np.random.default_rng(1).standard_normal((tokens, C)).astype(np.float32)
    times = _timed_runs(model, threads, x, max(repeat // 3, 3), warmup=1)
    time.sleep(1.0)  # let ONNX Runtime's spinning threads park before NumPy's BLAS probe
    probe = matmul_gflops()
    ms = float(np.median(times)) * 1e3
    return {
        "gflop": flops / 1e9,
        "kernel_ms": ms,
        "kernel_gflops": flops / (ms / 1e3) / 1e9,
        "probe_gflops": probe,
        "kernel_vs_floor": ms / (flops / (probe * 1e9) * 1e3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", action="store_true", help="JSON on stdout instead of the table")
    args = ap.parse_args()
    rows = []
    ctx = mp.get_context("spawn")
    for precision in PRECISIONS:
        with ctx.Pool(1) as pool:
            rows.append(pool.apply(measure, (precision, args.threads, args.repeat)))
    with ctx.Pool(1) as pool:
        prefill = pool.apply(measure_prefill, (args.threads, args.repeat))
    # fp32 matmuls at batch 1 are a pure weight stream: the bandwidth they reach is a second, stricter reference
    gemv_gbs = rows[0]["kernel_gbs"]
    for r in rows:
        r["vs_fp32_gemv_bandwidth"] = r["kernel_ms"] / (r["weight_mb"] / gemv_gbs)  # MB / (GB/s) = ms
    if args.json:
        print(json.dumps({"decode": rows, "prefill_fp32": prefill}, indent=2))
        return
    print(
        "| precision | weight MB | kernels ms (best) | GB/s | probe GB/s | floor ms | x floor | x fp32-GEMV bytes/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['precision']} | {r['weight_mb']:.1f} | {r['kernel_ms']:.2f} ({r['kernel_ms_best']:.2f}) | "
            f"{r['kernel_gbs']:.1f} | {r['probe_gbs']:.1f} | {r['floor_ms']:.2f} | {r['kernel_vs_floor']:.2f} | "
            f"{r['vs_fp32_gemv_bandwidth']:.2f} |"
        )
    p = prefill
    print(
        f"\nfp32 prefill matmuls, 128 tokens ({p['gflop']:.1f} GFLOP): {p['kernel_ms']:.1f} ms = "
        f"{p['kernel_gflops']:.0f} GFLOP/s against the probe's {p['probe_gflops']:.0f}: "
        f"{p['kernel_vs_floor']:.2f} x the FLOP floor before attention, norms and the head"
    )


if __name__ == "__main__":
    main()
