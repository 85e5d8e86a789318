"""The fixed part of a batch-1 decode step on the generate path: graph time against Python time, and the nodes.

    python benchmarks/fixed_step.py LABEL=TREE:FOLDER [LABEL=TREE:FOLDER ...] [--rounds 5] [--tokens 128]
                                    [--threads 2] [--workloads greedy,top-k] [--profile]

Each variant is a source tree (a checkout of gpt2edge: its code is what the child process imports) and an
export folder. Round by round (order alternating, each child under `flock $BENCH_LOCK`), a child process runs
`Generator.generate` on a 128-token prompt for `--tokens` new tokens (greedy; top-k 50 at temperature 0.8,
seeded) and splits every step (one sampled token to the next) into
  graph   the wall time inside `InferenceSession.run_with_iobinding` (ONNX Runtime's own run),
  python  the rest of the step: the forward's binding, the sampler, the row's bookkeeping, the text;
each as wall time and as the main thread's CPU time (`time.thread_time`: robust to other processes on a
shared host; the main thread also runs part of ONNX Runtime's work, so `graph` CPU is a lower bound), and
prints the medians per variant with their range over rounds and the per-round ratio to the first variant.
`--profile` also prints, once per variant, the session's node count after ONNX Runtime's optimizations and
its kernel time by group from ONNX Runtime's profiler (SessionOptions.enable_profiling; decode steps only).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOCK = os.environ.get("BENCH_LOCK", "/tmp/bench.lock")
PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 12  # ~ 190 tokens, truncated
WORKLOADS = {"greedy": dict(do_sample=False), "top-k": dict(do_sample=True, top_k=50, temperature=0.8, seed=1)}
# kernel groups of the profile: what scales with the weights, with the context, and the fixed rest
GROUPS = {
    "weights": {"MatMulNBits", "MatMul", "Gemm", "MatMulInteger", "DynamicQuantizeMatMul", "GatherBlockQuantized"},
    "attention": {"GroupQueryAttention", "Attention", "MultiHeadAttention"},
    "per-layer small": {"LayerNormalization", "SkipLayerNormalization", "FastGelu", "BiasGelu", "Add"},
    "head": {"LogSoftmax", "If"},
}


class _Timed:
    """The session, with run_with_iobinding's wall and main-thread CPU time recorded."""

    def __init__(self, session) -> None:
        self._s, self.wall, self.cpu = session, 0.0, 0.0

    def __getattr__(self, name):
        return getattr(self._s, name)

    def run_with_iobinding(self, binding, options=None):
        w, c = time.perf_counter(), time.thread_time()
        self._s.run_with_iobinding(binding, options)
        self.wall += time.perf_counter() - w
        self.cpu += time.thread_time() - c


def _child(folder: str, tokens: int, threads: int, workload: str) -> dict:
    """One generation, its steps split (ms per step, medians)."""
    from gpt2edge.runtime.generator import Generator

    gen = Generator(folder, threads=threads)
    lm = gen.lm
    timed = _Timed(lm.session)
    lm.session = timed
    steps: list[tuple[float, float, float, float]] = []
    mark = [0.0, 0.0, 0.0, 0.0]

    def on_step(step) -> None:
        w, c = time.perf_counter(), time.thread_time()
        if step.index > 0:  # step 0 follows the prefill
            steps.append((w - mark[0], c - mark[1], timed.wall - mark[2], timed.cpu - mark[3]))
        mark[:] = [w, c, timed.wall, timed.cpu]

    kw = dict(max_new_tokens=tokens, ignore_eos=True, truncate=True, **WORKLOADS[workload])
    gen.generate(PROMPT[: 4 * 128], **kw)  # warm-up
    steps.clear()
    gen.generate(PROMPT[: 4 * 128], callback=on_step, **kw)
    cols = list(zip(*steps))
    wall, cpu, gwall, gcpu = (st.median(c) * 1e3 for c in cols)
    py_wall = st.median(a - b for a, b in zip(cols[0], cols[2])) * 1e3
    py_cpu = st.median(a - b for a, b in zip(cols[1], cols[3])) * 1e3
    return {"step_ms": wall, "graph_ms": gwall, "python_ms": py_wall, "step_cpu_ms": cpu, "graph_cpu_ms": gcpu,
            "python_cpu_ms": py_cpu}  # fmt: skip


def _profile(folder: str, tokens: int, threads: int) -> dict:
    """Node count after optimization and kernel us per decode step by group (ONNX Runtime's profiler)."""
    import onnx
    import onnxruntime as ort

    from gpt2edge.runtime.generator import Generator

    tmp = tempfile.mkdtemp(prefix="fixed-step-")
    real = ort.SessionOptions

    class Profiled(real):  # the runtime's own options, plus the profiler and a copy of the optimized graph
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = f"{tmp}/prof"
            self.optimized_model_filepath = f"{tmp}/opt.onnx"
            self.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.data")

    ort.SessionOptions = Profiled
    try:
        gen = Generator(folder, threads=threads)
    finally:
        ort.SessionOptions = real
    opt = onnx.load(f"{tmp}/opt.onnx", load_external_data=False)
    gen.generate(PROMPT[: 4 * 128], max_new_tokens=tokens, ignore_eos=True, truncate=True, do_sample=False)
    events = json.loads(Path(gen.graph.session.end_profiling()).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[1:]  # no prefill
    groups: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        if not any(a <= e["ts"] <= b for a, b in runs[-64:]):
            continue
        op = e["args"]["op_name"]
        g = next((k for k, ops in GROUPS.items() if op in ops), "preamble and shapes")
        groups[g] = groups.get(g, 0.0) + e["dur"] / min(64, len(runs))
    run_us = st.median(b - a for a, b in runs[-64:])
    d = gen.folder.dims
    return {"nodes": len(opt.graph.node), "n_layer": d["n_layer"], "run_us": run_us, "kernel_us": groups}


def _spawn(tree: str, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = subprocess.run([sys.executable, __file__, *args], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(xs: list[float]) -> str:
    return f"{st.median(xs):.3f} [{min(xs):.3f}..{max(xs):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", help="LABEL=TREE:FOLDER")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="greedy,top-k")
    ap.add_argument("--profile", action="store_true", help="node count and kernel time by group, once per variant")
    ap.add_argument("--child", nargs=3, metavar=("FOLDER", "WORKLOAD", "KIND"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        folder, workload, kind = a.child
        run = _profile(folder, a.tokens, a.threads) if kind == "profile" else None
        print(json.dumps(run or _child(folder, a.tokens, a.threads, workload)))
        return
    variants = []
    for v in a.variants:
        label, rest = v.split("=", 1)
        tree, folder = rest.split(":", 1)
        if (Path(folder) / "sparse_head.npz").exists():  # its steps run two sessions and a native call
            sys.exit(f"error: {folder} has a sparse head; time it with benchmarks/sparse_head.py --breakdown")
        variants.append((label, str(Path(tree).resolve()), folder))
    common = ["--tokens", str(a.tokens), "--threads", str(a.threads)]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}")
    if a.profile:
        print("| variant | nodes (optimized) | run us/step | kernel us/step by group |\n|---|---|---|---|")
        for label, tree, folder in variants:
            p = _spawn(tree, ["--child", folder, "greedy", "profile", *common])
            ks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(p["kernel_us"].items(), key=lambda kv: -kv[1]))
            print(f"| {label} | {p['nodes']} ({p['n_layer']} layers) | {p['run_us']:.0f} | {ks} |")
    keys = ["step_ms", "graph_ms", "python_ms", "step_cpu_ms", "python_cpu_ms"]
    for w in a.workloads.split(","):
        res: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
        for r in range(a.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for label, tree, folder in order:
                res[label].append(_spawn(tree, ["--child", folder, w, "time", *common]))
        print(f"\n{w}, {a.rounds} rounds, ms per step: median [min..max]; ratio = per-round variant / {variants[0][0]}")
        print("| variant | " + " | ".join(keys) + " | step ratio | python cpu ratio |")
        print("|---|" + "---|" * (len(keys) + 2))
        base = res[variants[0][0]]
        for label, _, _ in variants:
            rows = res[label]
            cells = [_fmt([x[k] for x in rows]) for k in keys]
            ratio = [x["step_ms"] / b["step_ms"] for x, b in zip(rows, base)]
            pyr = [x["python_cpu_ms"] / b["python_cpu_ms"] for x, b in zip(rows, base)]
            print(f"| {label} | " + " | ".join(cells) + f" | {_fmt(ratio)} | {_fmt(pyr)} |")


if __name__ == "__main__":
    main()
