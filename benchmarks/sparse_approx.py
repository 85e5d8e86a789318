"""The approximate (cluster) sparse head against the full head of the same precision: quality and speed.

    python benchmarks/sparse_approx.py [--model ../shared/trained-gpt2-py] [--work /tmp/sparse-approx]
                                       [--settings 1024x16,1024x8,256x4,4096x32] [--precisions int8,int4]
                                       [--text FILE ...] [--report-tokens 1024] [--rounds 4] [--tokens 128]
                                       [--threads 2] [--quality-only] [--candidates] [--json]

Builds (once, under --work) the shared-cache fp32 export of --model, its int8 / int4 variants and, per setting
KxM (K clusters, M probed), `gpt2edge sparse-head --mode cluster` of each with its make-time quality report on
the held-out --text (default: this repository's gpt2edge/runtime/decoding/*.py, concatenated: Python source the
model never saw; it was trained on CPython's standard library). Prints the report of each folder (mean / max
KL against the full head, top-1 agreement, perplexity full / approximate, rows read per step).

Speed (without --quality-only): for each precision and setting, rounds in A B B A order, each pair under
`flock $BENCH_LOCK`: decode ms/token (median of generate()'s per-call medians over 3 code prompts, greedy and
top-p 0.9 sampling) of the full folder and the approximate one; the per-round ratio full / approximate, median
and range; and the head alone (one hidden state through the parent's head graph vs approx.onnx, median ms).
--candidates: cluster probes against SimHash buckets as candidate sets, offline (candidates_offline).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics as st
import subprocess
import sys
import time
from pathlib import Path

LOCK = os.environ.get("BENCH_LOCK", "/tmp/bench.lock")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "import os\n\ndef main(argv):\n    ",
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n",
    'def read_config(path):\n    """Read the configuration file at path."""\n',
]
WORKLOADS = {"greedy": {}, "top-p 0.9": dict(do_sample=True, top_p=0.9, temperature=0.8, seed=7)}


def gpt2edge(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gpt2edge.cli", *args], check=True, stdout=subprocess.DEVNULL)


def default_text(work: Path) -> Path:
    out = work / "heldout.txt"
    if not out.exists():
        files = sorted((ROOT / "gpt2edge" / "runtime" / "decoding").glob("*.py"))
        out.write_text("".join(f.read_text() for f in files))
    return out


def build(args) -> dict[str, Path]:
    """name -> folder: the precisions' full folders and their cluster variants, built when missing."""
    work = args.work
    fp32 = work / "fp32"
    if not fp32.exists():
        gpt2edge("export", "-m", args.model, str(fp32), "--kv-cache", "shared", "--no-validate")
    out = {}
    for p in args.precisions.split(","):
        full = work / p
        if p != "fp32" and not full.exists():
            gpt2edge("quantize", str(fp32), "-o", str(full), "--mode", p, "--no-report")
        out[p] = full
        for s in args.settings.split(","):
            k, m = s.split("x")
            folder = work / f"{p}-c{k}x{m}"
            if not folder.exists():
                opts = ["--mode", "cluster", "--clusters", k, "--probe", m, "--text", str(args.text)]
                gpt2edge("sparse-head", str(full), "-o", str(folder), *opts, "--report-tokens", str(args.report_tokens))
            out[f"{p} {s}"] = folder
    return out


def decode(gen, kw: dict, tokens: int) -> float:
    """Median over the prompts of generate()'s decode median (ms/token)."""
    return st.median(
        gen.generate(p, max_new_tokens=tokens, ignore_eos=True, **kw).timings["decode_ms_per_token_median"]
        for p in PROMPTS
    )


def head_ms(run, reps: int = 300) -> float:
    for _ in range(30):
        run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append((time.perf_counter() - t0) * 1e3)
    return st.median(ts)


def locked(fn):
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return fn()


def speed(full_dir: Path, apx_dir: Path, args) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort

    from gpt2edge.runtime.generator import Generator
    from gpt2edge.sparse.graph import split_head

    full, apx = Generator(full_dir, threads=args.threads), Generator(apx_dir, threads=args.threads)
    out = {}
    for name, kw in WORKLOADS.items():
        decode(full, kw, 8), decode(apx, kw, 8)  # warm-up
        a, b, ratio = [], [], []
        for r in range(args.rounds):
            order = [("full", full), ("apx", apx)][:: 1 if r % 2 == 0 else -1]
            got = locked(lambda order=order, kw=kw: {label: decode(g, kw, args.tokens) for label, g in order})
            a.append(got["full"])
            b.append(got["apx"])
            ratio.append(got["full"] / got["apx"])
        out[name] = dict(full_ms=st.median(a), approx_ms=st.median(b), ratio=st.median(ratio),
                         ratio_range=[min(ratio), max(ratio)])  # fmt: skip
    # the head alone: the parent's head graph (split off its graph) against approx.onnx, one hidden state
    V, C = full.graph.vocab_size, full.folder.dims.n_embd
    _, head, _ = split_head(onnx.load(str(full_dir / "model.onnx")), V, C)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(head.SerializeToString(), so, providers=["CPUExecutionProvider"])
    h = np.random.default_rng(0).standard_normal((1, C)).astype(np.float32)
    hf, ha = [], []
    for r in range(args.rounds):
        pair = [("f", lambda: sess.run(None, {"hidden": h})), ("a", lambda: apx.graph.head(h))][:: 1 - 2 * (r % 2)]
        got = locked(lambda pair=pair: {k: head_ms(fn) for k, fn in pair})
        hf.append(got["f"])
        ha.append(got["a"])
    out["head alone"] = dict(full_ms=st.median(hf), approx_ms=st.median(ha),
                             ratio=st.median(f / a for f, a in zip(hf, ha)))  # fmt: skip
    return out


def candidates_offline(parent: Path, apx_dir: Path, text: Path, n_tokens: int) -> dict:
    """Why clusters and not LSH: on the same hidden states (the held-out text through the body), how often the
    full head's best token is among the candidates, and how much of its probability mass they hold, for the
    cluster probe (K = 1024) and for SimHash over the rows (simple-LSH's transform for inner products: rows
    scaled by the largest norm plus one coordinate sqrt(1 - |w|^2), the query normalised), L tables of b bits,
    candidates = the union of the query's buckets."""
    import numpy as np
    import onnx

    from gpt2edge.runtime.generator import Generator
    from gpt2edge.sparse.approx_cluster import cluster_rows
    from gpt2edge.sparse.approx_report import hidden_states
    from gpt2edge.sparse.graph import split_head

    gen = Generator(apx_dir)
    ids = gen.tokenizer.encode(text.read_text())[:n_tokens]
    H = hidden_states(gen.graph.body, ids, gen.graph.n_positions).astype(np.float64)
    _, _, table = split_head(onnx.load(str(parent / "model.onnx")), gen.graph.vocab_size, gen.folder.dims.n_embd)
    W = table.dequantized().astype(np.float64)
    logits = H @ W.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    best = logits.argmax(1)

    def score(cands: list) -> dict:
        return dict(rows=float(np.mean([len(c) for c in cands])),
                    top1_recall=float(np.mean([b in c for b, c in zip(best, cands)])),
                    mass=float(np.mean([p[i, c].sum() for i, c in enumerate(cands)])))  # fmt: skip

    out = {}
    clusters = cluster_rows(W.astype(np.float32), 1024)
    members, cs = clusters.members(), H @ clusters.centroids.T.astype(np.float64)
    for m in (8, 16, 32):
        top = np.argsort(-cs, 1)[:, :m]
        out[f"cluster 1024 x {m}"] = score([np.unique(members[t][members[t] < len(W)]) for t in top])
    norms = np.linalg.norm(W, axis=1)
    Wt = np.hstack([W / norms.max(), np.sqrt(np.maximum(0, 1 - (norms / norms.max()) ** 2))[:, None]])
    Q = np.hstack([H / np.linalg.norm(H, axis=1, keepdims=True), np.zeros((len(H), 1))])
    rng = np.random.default_rng(0)
    for bits, tables in ((8, 4), (10, 16), (8, 8)):
        cands = [[] for _ in H]
        for _ in range(tables):
            R = rng.standard_normal((Wt.shape[1], bits))
            wc, qc = ((Wt @ R) > 0) @ (1 << np.arange(bits)), ((Q @ R) > 0) @ (1 << np.arange(bits))
            for i, c in enumerate(qc):
                cands[i].append(np.flatnonzero(wc == c))
        out[f"simhash {bits} bits x {tables} tables"] = score([np.unique(np.concatenate(c)) for c in cands])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = next((d for d in (ROOT.parent / "shared", ROOT.parents[1] / "shared") if d.exists()), Path("shared"))
    ap.add_argument("--model", default=str(shared / "trained-gpt2-py"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparse-approx"))
    ap.add_argument("--settings", default="1024x16,1024x8,256x4,4096x32")
    ap.add_argument("--speed-settings", default="1024x16", help="the settings timed (a subset of --settings)")
    ap.add_argument("--precisions", default="int8,int4")
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--report-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quality-only", action="store_true")
    ap.add_argument("--candidates", action="store_true", help="also cluster vs LSH candidates, offline (int8)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.text = args.text or default_text(args.work)
    folders = build(args)
    quality = {}
    for name, folder in folders.items():
        if " " in name:
            q = json.loads((folder / "manifest.json").read_text())["quality"]
            keys = ("mean_kl", "max_kl", "top1_agreement", "perplexity_reference", "perplexity_variant",
                    "rows_read_per_step", "rows_read_fraction", "greedy_match", "greedy_tokens", "tokens")  # fmt: skip
            quality[name] = {k: q[k] for k in keys}
    offline = {}
    if args.candidates:
        p = args.precisions.split(",")[0]
        s = args.settings.split(",")[0]
        offline = candidates_offline(folders[p], folders[f"{p} {s}"], args.text, args.report_tokens)
    timing = {}
    if not args.quality_only:
        for p in args.precisions.split(","):
            for s in args.speed_settings.split(","):
                timing[f"{p} {s}"] = speed(folders[p], folders[f"{p} {s}"], args)
    if args.json:
        print(json.dumps(dict(text=str(args.text), quality=quality, speed=timing, candidates=offline), indent=2))
        return
    print(f"held-out text: {args.text}; {args.threads} threads")
    print(f"{'folder KxM':18} {'rows/step':>14} {'mean KL':>8} {'max KL':>7} {'top-1':>7} {'ppl full/approx':>17} "
          f"{'greedy':>7}")  # fmt: skip
    for name, q in quality.items():
        rows = f"{q['rows_read_per_step']} ({q['rows_read_fraction']:.1%})"
        ppl = f"{q['perplexity_reference']:.1f} / {q['perplexity_variant']:.1f}"
        print(f"{name:18} {rows:>14} {q['mean_kl']:8.4f} {q['max_kl']:7.3f} {q['top1_agreement']:7.1%} {ppl:>17} "
              f"{q['greedy_match']:>3}/{q['greedy_tokens']}")  # fmt: skip
    for name, c in offline.items():
        print(f"{name:28} candidates {c['rows']:7.0f}  best token among them {c['top1_recall']:6.1%}  "
              f"probability mass {c['mass']:6.1%}")  # fmt: skip
    for name, t in timing.items():
        for w, v in t.items():
            rng = f" ({v['ratio_range'][0]:.2f}-{v['ratio_range'][1]:.2f})" if "ratio_range" in v else ""
            print(f"{name:18} {w:11} full {v['full_ms']:.3f} ms  approx {v['approx_ms']:.3f} ms  "
                  f"speed-up {v['ratio']:.2f}x{rng}")  # fmt: skip


if __name__ == "__main__":
    main()
