"""fp32 GEMV variants at gpt2-xl's shape: does any standard ONNX op, weight layout or session option make ONNX
Runtime's batch-1 fp32 matmul stream its weights faster?

    python benchmarks/gemv_variants.py build DIR [--layers 24]        # weights + one graph per op (unlocked)
    flock /tmp/bench.lock chrt -f 10 python benchmarks/gemv_variants.py run DIR --round 1 [--reverse] \\
        [--llama-gguf /work/peers/scale/gpt2-xl-f32.gguf]                  # one round, ~2 min, JSON in DIR
    python benchmarks/gemv_variants.py summary DIR                    # the table over every round in DIR

`build` writes `--layers` pairs of xl MLP matmuls ([1,1600]x[1600,6400] then [1,6400]x[6400,1600], seeded
random weights scaled by 1/sqrt(K), ~82 MB a pair: 24 pairs = 1.97 GB, 60x the 32 MB L3, so every run
streams them from DRAM) twice, row-major [K,N] and transposed [N,K], into two external-data files that every
graph shares, and the float64 reference output of the chain. Each graph is a chain of one op kind (MatMul,
Gemm, Gemm transB=1, MatMul over a folded Transpose, com.microsoft FusedMatMul transB=1, N split into two
Gemms + Concat, Einsum). `run` times each variant (graph x session options) in a fresh process (ONNX
Runtime's spinning pools of separate sessions would slow each other): 3 warm-up runs, then up to 25 runs or
4 s, median and min, GB/s = weight bytes / median, and the output's max error relative to max |reference|.
References in the same round: NumPy's OpenBLAS sgemv over the transposed weights (row dot products, like
llama.cpp's F32 path), the `gpt2edge bench` read-bandwidth probe, and `llama-bench -p 0 -n 32 -t 2` on the
xl F32 GGUF (GB/s from the manifest's 6.22 GB read per decode step, an upper bound: llama.cpp's step also
reads the KV cache). `--reverse` runs the list backwards, so rounds go A B B A.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

C, INNER = 1600, 6400  # gpt2-xl: n_embd, MLP width
XL_DECODE_BYTES = 6_223_891_272  # /work/scale/xl-fp32 manifest: weights one decode step reads
FILES = {"kn": "w_kn.bin", "nk": "w_nk.bin"}  # [K, N] row-major and its transpose [N, K]


@dataclass(frozen=True)
class Variant:
    graph: str  # which graph file (op kind and weight layout)
    config: tuple[tuple[str, str], ...] = ()  # session config entries
    threads: int = 2
    level: str = "all"  # graph optimization level
    parallel: bool = False  # ORT_PARALLEL executor, inter-op 2, intra-op 1
    pin_main: bool = False  # pin the calling thread to CPU 0 (ORT pins only its workers)
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the variant's process
    note: str = ""


NOPACK = (("session.disable_prepacking", "1"),)
VARIANTS: dict[str, Variant] = {
    "matmul": Variant("matmul", note="MatMul, B [K,N], prepacked (what export emits)"),
    "matmul-noprepack": Variant("matmul", NOPACK, note="MatMul, no prepacking (MLAS M=1 kernel)"),
    "matmul-nospin": Variant("matmul", (("session.intra_op.allow_spinning", "0"),), note="MatMul, no spinning"),
    "matmul-affinity": Variant(
        "matmul", (("session.intra_op_thread_affinities", "2"),), pin_main=True, note="MatMul, threads pinned 0/1"
    ),
    "matmul-extended": Variant("matmul", level="extended", note="MatMul, ORT_ENABLE_EXTENDED"),
    "matmul-1thread": Variant("matmul", threads=1, note="MatMul, 1 intra-op thread"),
    "matmul-hugetlb": Variant(
        "matmul", env=(("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"),), note="MatMul, glibc malloc in THP (env)"
    ),
    "gemm": Variant("gemm", note="Gemm, B [K,N]"),
    "gemm-tb": Variant("gemm_tb", note="Gemm transB=1, B [N,K]"),
    "gemm-tb-noprepack": Variant("gemm_tb", NOPACK, note="Gemm transB=1, no prepacking (M=1 transB kernel)"),
    "matmul-transpose": Variant("matmul_tr", note="MatMul(x, Transpose(B [N,K])), folded"),
    "fused-tb": Variant("fused_tb", note="FusedMatMul transB=1, B [N,K]"),
    "fused-tb-noprepack": Variant("fused_tb", NOPACK, note="FusedMatMul transB=1, no prepacking"),
    "split2": Variant("split2", note="N in two halves: 2 Gemm transB=1 + Concat"),
    "split2-parallel": Variant("split2", parallel=True, note="the same, ORT_PARALLEL, inter-op 2 x intra-op 1"),
    "einsum": Variant("einsum", note="Einsum bk,nk->bn, B [N,K]"),
    "numpy-sgemv": Variant("numpy", note="reference: NumPy OpenBLAS sgemv over B [N,K], 2 threads"),
}


def layer_shapes(layers: int) -> list[tuple[int, int]]:
    """(K, N) of each matmul in the chain: the xl MLP's fc then proj, `layers` times."""
    return [(C, INNER), (INNER, C)] * layers


def build(root: Path, layers: int, seed: int = 0) -> None:
    """Both weight files, every graph, and io.npz (input, float64 reference output)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, C)).astype(np.float32)
    y = x.astype(np.float64)
    with open(root / FILES["kn"], "wb") as fkn, open(root / FILES["nk"], "wb") as fnk:
        for K, N in layer_shapes(layers):
            w = rng.standard_normal((K, N), dtype=np.float32) / np.float32(np.sqrt(K))  # keeps |y| ~ |x|
            fkn.write(w.tobytes())
            fnk.write(np.ascontiguousarray(w.T).tobytes())
            y = y @ w.astype(np.float64)
    np.savez(root / "io.npz", x=x, ref=y)
    for graph in sorted({v.graph for v in VARIANTS.values()} - {"numpy"}):
        (root / f"{graph}.onnx").write_bytes(build_graph(graph, layers).SerializeToString())
    print(f"built {root}: {layers} pairs, {sum(K * N for K, N in layer_shapes(layers)) * 4 / 1e9:.2f} GB a file")


def _external(name: str, layout: str, shape: tuple[int, int], offset: int):
    """An initializer whose data lies in the shared weight file `layout` at `offset` (4 KB-aligned here)."""
    from onnx import TensorProto

    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
    t.data_location = TensorProto.EXTERNAL
    length = shape[0] * shape[1] * 4
    for key, value in (("location", FILES[layout]), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def build_graph(graph: str, layers: int):
    """The chain of `layers` fc/proj pairs as one ONNX model using `graph`'s op and weight layout."""
    from onnx import TensorProto, helper

    nodes, inits, x, offset = [], [], "x", 0
    for i, (K, N) in enumerate(layer_shapes(layers)):
        w, y = f"w{i}", f"y{i}"
        if graph in ("matmul", "gemm"):
            inits.append(_external(w, "kn", (K, N), offset))
            nodes.append(helper.make_node("MatMul" if graph == "matmul" else "Gemm", [x, w], [y]))
        elif graph == "gemm_tb":
            inits.append(_external(w, "nk", (N, K), offset))
            nodes.append(helper.make_node("Gemm", [x, w], [y], transB=1))
        elif graph == "fused_tb":
            inits.append(_external(w, "nk", (N, K), offset))
            nodes.append(helper.make_node("FusedMatMul", [x, w], [y], domain="com.microsoft", transB=1))
        elif graph == "matmul_tr":
            inits.append(_external(w, "nk", (N, K), offset))
            nodes.append(helper.make_node("Transpose", [w], [f"{w}.t"], perm=[1, 0]))
            nodes.append(helper.make_node("MatMul", [x, f"{w}.t"], [y]))
        elif graph == "split2":  # rows of B [N,K] are contiguous: each half is one slice of the file
            half = N // 2
            for h in range(2):
                inits.append(_external(f"{w}.{h}", "nk", (half, K), offset + h * half * K * 4))
                nodes.append(helper.make_node("Gemm", [x, f"{w}.{h}"], [f"{y}.{h}"], transB=1))
            nodes.append(helper.make_node("Concat", [f"{y}.0", f"{y}.1"], [y], axis=1))
        elif graph == "einsum":
            inits.append(_external(w, "nk", (N, K), offset))
            nodes.append(helper.make_node("Einsum", [x, w], [y], equation="bk,nk->bn"))
        else:
            raise ValueError(f"unknown graph {graph!r}")
        x, offset = y, offset + K * N * 4
    g = helper.make_graph(
        nodes,
        graph,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, C])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def _time(fn, warmup: int = 3, repeat: int = 25, budget_s: float = 4.0) -> tuple[list[float], np.ndarray]:
    """Seconds of each timed call of fn after `warmup` untimed ones, and its last output."""
    for _ in range(warmup):
        out = fn()
    times, start = [], time.perf_counter()
    while len(times) < repeat and (len(times) < 5 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def _numpy_runner(root: Path, layers: int, x: np.ndarray):
    """Row dot products over B [N,K] held in malloc'd memory (OpenBLAS sgemv, threads from the environment)."""
    flat = np.fromfile(root / FILES["nk"], dtype=np.float32)
    mats, offset = [], 0
    for K, N in layer_shapes(layers):
        mats.append(flat[offset : offset + K * N].reshape(N, K))
        offset += K * N

    def run() -> np.ndarray:
        y = x[0]
        for m in mats:
            y = m @ y  # (N,)
        return y[None]

    return run


def _ort_runner(root: Path, name: str, v: Variant, x: np.ndarray):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1 if v.parallel else v.threads
    if v.parallel:
        opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        opts.inter_op_num_threads = 2
    opts.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[v.level]
    for key, value in v.config:
        opts.add_session_config_entry(key, value)
    if v.pin_main:
        os.sched_setaffinity(0, {0})
    sess = ort.InferenceSession(str(root / f"{v.graph}.onnx"), opts, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, {"x": x})[0]


def child(root: Path, name: str) -> dict:
    """One variant in this (fresh) process: load, time, check the output."""
    v = VARIANTS[name]
    io = np.load(root / "io.npz")
    x, ref = io["x"], io["ref"]
    layers = int(json.loads((root / "meta.json").read_text())["layers"])
    t0 = time.perf_counter()
    fn = _numpy_runner(root, layers, x) if v.graph == "numpy" else _ort_runner(root, name, v, x)
    load_s = time.perf_counter() - t0
    times, out = _time(fn)
    nbytes = sum(K * N for K, N in layer_shapes(layers)) * 4
    med = statistics.median(times)
    return {
        "variant": name,
        "note": v.note,
        "median_ms": med * 1e3,
        "min_ms": min(times) * 1e3,
        "runs": len(times),
        "gbs": nbytes / med / 1e9,
        "load_s": load_s,
        "rel_err": float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "anon_huge_gb": anon_huge_gb(),
    }


def anon_huge_gb() -> float | None:
    """GB of this process's anonymous memory in transparent huge pages (Linux), else None."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def interleave(root: Path, names: list[str], cycles: int, gap_ms: float) -> dict:
    """Several variants loaded in this one process, timed one run each in turn (A B C, then C B A, ...), with a
    pause before each run so the previous variant's spinning threads park: on a host whose memory bandwidth
    drifts over seconds (other tenants), the ratio within a cycle is what compares them, not separate rounds."""
    io = np.load(root / "io.npz")
    x, ref = io["x"], io["ref"]
    layers = int(json.loads((root / "meta.json").read_text())["layers"])
    runners = {}
    for name in names:
        v = VARIANTS[name]
        runners[name] = _numpy_runner(root, layers, x) if v.graph == "numpy" else _ort_runner(root, name, v, x)
    errs = {}
    for name, fn in runners.items():
        for _ in range(3):
            out = fn()
        errs[name] = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    times: dict[str, list[float]] = {name: [] for name in names}
    for c in range(cycles):
        for name in names if c % 2 == 0 else names[::-1]:
            time.sleep(gap_ms / 1e3)
            t0 = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - t0)
    nbytes = sum(K * N for K, N in layer_shapes(layers)) * 4
    base = names[0]
    rows = []
    for name in names:
        ratios = sorted(t / b for t, b in zip(times[name], times[base]))
        med = statistics.median(times[name])
        rows.append({"variant": name, "median_ms": med * 1e3, "min_ms": min(times[name]) * 1e3,
                     "gbs": nbytes / med / 1e9, "ratio_median": statistics.median(ratios),
                     "ratio_q1": ratios[len(ratios) // 4], "ratio_q3": ratios[(3 * len(ratios)) // 4],
                     "rel_err": errs[name]})
    return {"base": base, "cycles": cycles, "gap_ms": gap_ms, "rows": rows,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def profile(folder: Path, new_tokens: int, threads: int, prefix: Path) -> dict:
    """Where a real folder's decode step goes: ONNX Runtime's profiler over one `gpt2edge bench`-style run
    (prompt 128, `new_tokens` new, after an unprofiled-in-the-sum warm-up), node time summed by op type per
    decode step, next to the step's wall time (the rest: the runtime's Python and the framework between
    nodes). Profiling adds a timestamp per node, so the step is a little slower than in `bench`."""
    import gc

    import onnxruntime as ort

    from gpt2edge.bench.workload import BenchConfig, Workload

    original = ort.SessionOptions

    def profiled() -> ort.SessionOptions:
        opts = original()
        opts.enable_profiling = True
        opts.profile_file_prefix = str(prefix)
        return opts

    ort.SessionOptions = profiled  # only for this one-off process: create_session builds its options here
    work = Workload(folder, BenchConfig(prompt_len=128, new_tokens=new_tokens, threads=threads))
    ort.SessionOptions = original
    work.run(128, new_tokens)  # warm-up
    state = work.run(128, new_tokens)
    files = [o.end_profiling() for o in gc.get_objects() if isinstance(o, ort.InferenceSession)]
    events = json.loads(Path(files[0]).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    last = runs[-new_tokens:]  # the timed generation's runs: 1 prefill + new_tokens - 1 decode steps
    decode = last[1:]
    spans = [(r["ts"], r["ts"] + r["dur"]) for r in decode]
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            if any(a <= e["ts"] <= b for a, b in spans):
                op = e["args"].get("op_name", "?")
                by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e3 / len(decode)
    return {"folder": str(folder), "decode_steps": len(decode),
            "step_ms_wall": float(np.median(state.decode_ms)),
            "model_run_ms": statistics.mean(r["dur"] / 1e3 for r in decode),
            "op_ms_per_step": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


def llama_bench(binary: Path, gguf: Path, threads: int) -> dict:
    """llama-bench tg32 (batch 1): ms per token, and GB/s if a step reads the xl manifest's weight bytes."""
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", "32", "-t", str(threads), "-r", "2", "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    ms = 1e3 / rows[0]["avg_ts"]
    return {"variant": "llama.cpp-F32", "note": f"llama-bench {gguf.name} -p 0 -n 32 -t {threads} -r 2",
            "median_ms": ms, "gbs": XL_DECODE_BYTES / (ms / 1e3) / 1e9}


def run_round(
    root: Path, rnd: int, reverse: bool, names: list[str], llama: tuple[Path, Path] | None, tag: str = "round"
) -> None:
    from gpt2edge.bench.probe import read_bandwidth_gbs

    order = names + (["llama.cpp-F32"] if llama else [])
    order = order[::-1] if reverse else order
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")
    rows, probes = [], [read_bandwidth_gbs(2)]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for name in order:
        if name == "llama.cpp-F32":
            rows.append(llama_bench(*llama, threads=2))
        else:
            cmd = [sys.executable, __file__, "child", str(root), name]
            out = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, **dict(VARIANTS[name].env)))
            if out.returncode != 0:
                rows.append({"variant": name, "error": out.stderr.strip().splitlines()[-1:]})
            else:
                rows.append(json.loads(out.stdout))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    probes.append(read_bandwidth_gbs(2))
    result = {"round": rnd, "reverse": reverse, "started": started, "loadavg": os.getloadavg(),
              "probe_gbs": probes, "rows": rows}
    (root / f"{tag}-{rnd}.json").write_text(json.dumps(result, indent=1))


def summary(root: Path, tag: str = "round") -> None:
    """Per variant over the rounds: GB/s median, time vs the same round's MatMul (median [range]), best ms."""
    rounds = [json.loads(p.read_text()) for p in sorted(root.glob(f"{tag}-*.json"))]
    by: dict[str, list[tuple[dict, float]]] = {}
    for r in rounds:
        rows = [row for row in r["rows"] if "median_ms" in row]  # a variant may run several times a round
        base = statistics.median(row["median_ms"] for row in rows if row["variant"] == "matmul")
        for row in rows:
            by.setdefault(row["variant"], []).append((row, row["median_ms"] / base))
    probes = [p for r in rounds for p in r["probe_gbs"]]
    print(f"{len(rounds)} rounds; read probe {min(probes):.1f}..{max(probes):.1f} GB/s; load averages "
          + ", ".join(f"{r['loadavg'][0]:.2f}" for r in rounds))
    print("| variant | GB/s (median) | median ms [range] | best ms | x MatMul time, median [range] | max rel. err |")
    print("|---|---|---|---|---|---|")
    for name, got in sorted(by.items(), key=lambda kv: statistics.median(x for _, x in kv[1])):
        meds = [row["median_ms"] for row, _ in got]
        ratios = [x for _, x in got]
        best = min(row.get("min_ms", row["median_ms"]) for row, _ in got)
        errs = [row["rel_err"] for row, _ in got if "rel_err" in row]
        err = f"{max(errs):.1e}" if errs else "n/a"
        print(f"| {name} | {statistics.median(row['gbs'] for row, _ in got):.1f} | "
              f"{statistics.median(meds):.1f} [{min(meds):.1f}..{max(meds):.1f}] | {best:.1f} | "
              f"{statistics.median(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}] | {err} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--layers", type=int, default=24)
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("--round", type=int, required=True)
    r.add_argument("--reverse", action="store_true")
    r.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="may repeat")
    r.add_argument("--llama-bench", type=Path, default=Path("/work/peers/llama-build/bin/llama-bench"))
    r.add_argument("--llama-gguf", type=Path, help="run llama-bench on this GGUF in the same round")
    r.add_argument("--tag", default="round", help="the result is DIR/TAG-ROUND.json")
    i = sub.add_parser("interleave", help="variants in one process, run by run (first = baseline)")
    i.add_argument("dir", type=Path)
    i.add_argument("variants", nargs="+", choices=list(VARIANTS))
    i.add_argument("--cycles", type=int, default=40)
    i.add_argument("--gap-ms", type=float, default=30.0)
    i.add_argument("--out", type=Path)
    f = sub.add_parser("profile", help="a real folder's decode step by op type (ONNX Runtime's profiler)")
    f.add_argument("folder", type=Path)
    f.add_argument("--new-tokens", type=int, default=16)
    f.add_argument("--threads", type=int, default=2)
    f.add_argument("--prefix", type=Path, default=Path("/tmp/gemv-profile"))
    c = sub.add_parser("child")
    c.add_argument("dir", type=Path)
    c.add_argument("variant", choices=list(VARIANTS))
    s = sub.add_parser("summary")
    s.add_argument("dir", type=Path)
    s.add_argument("--tag", default="round")
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.dir, args.layers)
        (args.dir / "meta.json").write_text(json.dumps({"layers": args.layers}))
    elif args.cmd == "run":
        llama = (args.llama_bench, args.llama_gguf) if args.llama_gguf else None
        run_round(args.dir, args.round, args.reverse, args.variants, llama, args.tag)
    elif args.cmd == "interleave":
        result = interleave(args.dir, args.variants, args.cycles, args.gap_ms)
        result.update(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), loadavg=os.getloadavg())
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        print(f"baseline {result['base']}, {args.cycles} cycles, load {result['loadavg'][0]:.2f}")
        for r in result["rows"]:
            print(f"{r['variant']:20s} {r['median_ms']:7.1f} ms (best {r['min_ms']:6.1f}) {r['gbs']:5.1f} GB/s  "
                  f"x base {r['ratio_median']:.2f} [IQR {r['ratio_q1']:.2f}..{r['ratio_q3']:.2f}]  "
                  f"err {r['rel_err']:.1e}")
    elif args.cmd == "profile":
        print(json.dumps(profile(args.folder, args.new_tokens, args.threads, args.prefix), indent=1))
    elif args.cmd == "child":
        print(json.dumps(child(args.dir, args.variant)))
    else:
        summary(args.dir, args.tag)


if __name__ == "__main__":
    main()
