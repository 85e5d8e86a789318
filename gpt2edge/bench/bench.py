"""`gpt2edge bench`: prefill and decode latency of an export folder next to this machine's floors.

Workload: `batch` prompts of `prompt_len` seeded random token ids, `new_tokens` sampled tokens each
(temperature 0.8, top-k 50, top-p 0.9; EOS ignored), one warm-up run then `repeat` timed runs. Decode
figures pool every step of the timed runs: median (`decode_ms_per_token`, also named
`decode_ms_per_token_median`), mean, p90. Lengths left to their defaults (128 + 128) shrink to fit a model
with fewer positions. Only numpy, onnxruntime and tokenizers are used.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gpt2edge.bench.probe import last_level_cache_bytes, matmul_gflops, read_bandwidth_gbs
from gpt2edge.errors import GenerationError
from gpt2edge.runtime.generate import generate
from gpt2edge.runtime.lm import load_graph
from gpt2edge.runtime.model_folder import ModelFolder
from gpt2edge.runtime.sampling import SamplingParams
from gpt2edge.runtime.tokenizer import TextTokenizer

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
DEFAULT_PROMPT_LEN = 128
DEFAULT_NEW_TOKENS = 128
MIN_NEW_TOKENS = 2  # the first token comes from the prefill: at least one decode step to time


def fit_lengths(prompt_len: int | None, new_tokens: int | None, n_positions: int) -> tuple[int, int]:
    """Lengths the user gave stay as given; those left to default (None) shrink to fit the model's positions
    (both left to default: half each, at most 128)."""
    if prompt_len is None and new_tokens is None:
        prompt_len = min(DEFAULT_PROMPT_LEN, n_positions // 2)
    if prompt_len is None:
        prompt_len = min(DEFAULT_PROMPT_LEN, n_positions - new_tokens)
    if new_tokens is None:
        new_tokens = min(DEFAULT_NEW_TOKENS, n_positions - prompt_len)
    return prompt_len, new_tokens


@dataclass
class BenchConfig:
    prompt_len: int | None = None  # None: 128, shrunk to fit the model (see fit_lengths)
    new_tokens: int | None = None  # None: 128, shrunk to fit the model
    batch: int = 1
    threads: int | None = None
    device: str = "cpu"
    repeat: int = 5
    seed: int = 0

    def check_runs(self) -> None:
        """Clear errors before anything is loaded or timed (the sweep chooses its own lengths)."""
        if self.repeat < 1:
            raise GenerationError(f"--repeat must be >= 1, got {self.repeat}.")
        if self.batch < 1:
            raise GenerationError(f"--batch must be >= 1, got {self.batch}.")

    def fitted(self, n_positions: int) -> BenchConfig:
        """This config with both lengths set: defaults shrunk to fit, given values checked (clear errors)."""
        if (self.prompt_len is not None and self.prompt_len < 1) or (
            self.new_tokens is not None and self.new_tokens < MIN_NEW_TOKENS
        ):
            raise GenerationError(f"--prompt-len must be >= 1 and --new-tokens >= {MIN_NEW_TOKENS}.")
        prompt_len, new_tokens = fit_lengths(self.prompt_len, self.new_tokens, n_positions)
        if prompt_len < 1 or new_tokens < MIN_NEW_TOKENS or prompt_len + new_tokens > n_positions:
            given = [
                f for f, v in (("--prompt-len", self.prompt_len), ("--new-tokens", self.new_tokens)) if v is not None
            ]
            a = "a 1-token prompt" if self.prompt_len is None else f"--prompt-len {self.prompt_len}"
            b = f"{MIN_NEW_TOKENS} new tokens" if self.new_tokens is None else f"--new-tokens {self.new_tokens}"
            fix = "lower " + " or ".join(given) if given else "this model is too short to bench"
            raise GenerationError(f"{a} + {b} exceeds the model's {n_positions} positions; {fix}.")
        return dataclasses.replace(self, prompt_len=prompt_len, new_tokens=new_tokens)


class Workload:
    """A loaded model plus seeded prompts; `run()` is one timed generation."""

    def __init__(self, model_dir: Path, cfg: BenchConfig, fixed_lengths: bool = True):
        self.folder = ModelFolder.open(model_dir, verify=False)
        cfg.check_runs()
        self.lm = load_graph(self.folder, device=cfg.device, threads=cfg.threads).new_lm()  # OrtLM or StaticLM
        # the sweep chooses its own lengths; a fixed workload gets both lengths, fitted to the model (a static
        # graph: to its cache capacity)
        self.cfg = cfg.fitted(self.lm.n_positions) if fixed_lengths else cfg
        if fixed_lengths:  # a batch a static graph cannot take is refused now, not after the machine probes
            self.lm.start(self.cfg.batch, self.cfg.prompt_len + self.cfg.new_tokens - 1)
        self.tokenizer = TextTokenizer(self.folder.tokenizer_path)

    def run(self, prompt_len: int, new_tokens: int):
        params = SamplingParams(max_new_tokens=new_tokens, seed=self.cfg.seed, **SAMPLING)
        prompts = bench_prompts(self.cfg, self.folder.dims["vocab_size"], prompt_len)
        return generate(self.lm, self.tokenizer, prompts, params, pad_id=0)


def bench_prompts(cfg: BenchConfig, vocab_size: int, length: int | None = None) -> list[list[int]]:
    """`batch` seeded random prompts of `length` (default: cfg.prompt_len, or 128 when it is not fitted yet)."""
    rng = np.random.default_rng(cfg.seed)
    return rng.integers(0, vocab_size, (cfg.batch, length or cfg.prompt_len or DEFAULT_PROMPT_LEN)).tolist()


def progress(items, desc: str, unit: str, log):
    """A tqdm bar on a terminal only: piped or redirected stderr (logs, CI) gets no carriage-return noise."""
    isatty = getattr(log, "isatty", None)
    return tqdm(items, desc=desc, unit=unit, file=log, leave=False, disable=not (isatty and isatty()))


def floor_note(step_bytes: float, llc_bytes: int | None) -> str | None:
    """Why the memory-bandwidth floor does not bound a decode step, or None when it does (or we cannot tell).

    The floor assumes every byte of a step comes from DRAM; when they all fit in the last-level cache, steps
    after the first read them from cache and the floor says nothing (a ratio under 1 would be meaningless)."""
    if llc_bytes is None or step_bytes > llc_bytes:
        return None
    return (
        f"the {step_bytes / 1e6:.2f} MB a decode step reads fit in the {llc_bytes / 1e6:.1f} MB last-level "
        "cache: memory bandwidth does not bound decode"
    )


def kv_bytes_per_step(dims: dict[str, Any], batch: int, context: float, itemsize: int) -> float:
    """Bytes of past keys and values a decode step at `context` positions reads (every layer, K and V)."""
    return 2 * dims["n_layer"] * batch * dims["n_head"] * context * dims["head_dim"] * itemsize


def prefill_flops(dims: dict[str, Any], batch: int, seq: int) -> float:
    """Matmul FLOPs of a prefill: the blocks at every position, causal attention, the head at the last."""
    C, L = dims["n_embd"], dims["n_layer"]
    per_token = 2 * (3 * C * C + C * C + 2 * C * dims["n_inner"])  # qkv, proj, mlp in+out
    attention = 2 * 2 * C * seq * (seq + 1) / 2  # QK^T and AV over the causal triangle
    return batch * (L * (seq * per_token + attention) + 2 * C * dims["vocab_size"])


def run_bench(model_dir: Path, cfg: BenchConfig, log=None) -> dict[str, Any]:
    """Measure the model and the machine in one run; returns the bench record (see `bench_rows`)."""
    log = log or sys.stderr  # looked up per call: a caller (or a test runner) may have replaced sys.stderr
    work = Workload(Path(model_dir), cfg)
    dims = work.folder.dims
    defaults = (cfg.prompt_len or DEFAULT_PROMPT_LEN, cfg.new_tokens or DEFAULT_NEW_TOKENS)
    if (work.cfg.prompt_len, work.cfg.new_tokens) != defaults:
        print(
            f"bench: the model has {work.lm.n_positions} positions: prompt {work.cfg.prompt_len} + "
            f"{work.cfg.new_tokens} new tokens (defaults shrunk to fit)",
            file=log,
        )
    cfg = work.cfg
    threads = cfg.threads or 2
    # probe the machine before the warm-up and after the last run: a shared host's speed drifts within a run.
    # Not between timed runs: NumPy's BLAS threads keep spinning after the matmul probe and slow the prefill.
    probes = [(read_bandwidth_gbs(threads), matmul_gflops())]

    prefill, decode, sampler, tps = [], [], [], []
    run_decode_medians = []  # per timed run: the best run is the one a shared host disturbed least
    for i in progress(range(cfg.repeat + 1), "bench", "run", log):
        state = work.run(cfg.prompt_len, cfg.new_tokens)
        if i == 0:
            continue  # warm-up: first-run allocations and kernel selection
        prefill.append(state.prefill_ms)
        decode += state.decode_ms
        run_decode_medians.append(float(np.median(state.decode_ms)))
        sampler += state.sampler_ms
        total_s = (sum(state.decode_ms) + sum(state.sampler_ms)) / 1e3
        tps.append(cfg.batch * len(state.decode_ms) / total_s)

    itemsize = np.dtype(work.folder.kv_dtype).itemsize
    weights = work.folder.manifest["graph"].get("decode_weight_bytes") or work.folder.model_bytes()
    mean_context = cfg.prompt_len + (cfg.new_tokens - 1) / 2
    # shared: the fused attention reads the valid slots once, in place; concat: Concat reads the past and
    # attention reads the present, twice the mean context
    kv_read = (1 if work.lm.shared else 2) * kv_bytes_per_step(dims, cfg.batch, mean_context, itemsize)
    if work.folder.graph.static is not None:  # every slot of every row: the blend reads past, writes present,
        kv_read = 3 * kv_bytes_per_step(dims, work.lm.batch, work.lm.n_positions, itemsize)  # attention reads it
    step_bytes = weights + kv_read
    probes.append((read_bandwidth_gbs(threads), matmul_gflops()))
    bandwidths, gflops_runs = zip(*probes)
    decode_median = float(np.median(decode))
    bandwidth, gflops = max(bandwidths), max(gflops_runs)  # best of both probes, as each probe is a best-of
    llc = last_level_cache_bytes()
    note = floor_note(step_bytes, llc)
    floor_ms = None if note else step_bytes / (bandwidth * 1e9) * 1e3
    flops = prefill_flops(dims, cfg.batch, cfg.prompt_len)
    prefill_floor = flops / (gflops * 1e9) * 1e3
    return {
        "model": str(model_dir),
        "precision": work.folder.precision,
        "kv_cache": work.folder.kv_cache,
        "vocab_size": dims["vocab_size"],
        "config": asdict(cfg),
        "prefill_ms": float(np.median(prefill)),
        "prefill_floor_ms": prefill_floor,
        "prefill_vs_floor": float(np.median(prefill)) / prefill_floor,
        "prefill_ms_best": float(min(prefill)),
        "prefill_vs_floor_best": float(min(prefill)) / prefill_floor,
        "decode_ms_per_token": decode_median,  # the median, as the table prints (generate's --json: the mean)
        "decode_ms_per_token_median": decode_median,
        "decode_ms_per_token_mean": float(np.mean(decode)),
        "decode_ms_p90": float(np.percentile(decode, 90)),
        "tokens_per_s": float(np.median(tps)),
        "sampler_ms_per_token": float(np.mean(sampler)),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "model_bytes": work.folder.model_bytes(),
        "weight_bytes_per_step": int(weights),
        "bytes_read_per_step": int(step_bytes),
        "achieved_bandwidth_gbs": step_bytes / (decode_median / 1e3) / 1e9,
        "machine_read_bandwidth_gbs": bandwidth,
        "machine_read_bandwidth_range_gbs": [min(bandwidths), max(bandwidths)],
        "machine_matmul_gflops": gflops,
        "machine_matmul_gflops_range": [min(gflops_runs), max(gflops_runs)],
        "last_level_cache_bytes": llc,
        # null with a reason when the floor does not apply (the bytes of a step fit in the last-level cache)
        "decode_floor_ms": floor_ms,
        "decode_vs_floor": decode_median / floor_ms if floor_ms is not None else None,
        "decode_floor_note": note,
        # best-of against best-of: the probes keep their fastest reading, this keeps the fastest run's median
        "decode_ms_best_run": min(run_decode_medians),
        "decode_vs_floor_best_run": min(run_decode_medians) / floor_ms if floor_ms is not None else None,
    }


def sweep_contexts(n_positions: int, new_tokens: int) -> list[int]:
    """32, 64, 128, ... and the longest context that still leaves room for `new_tokens`."""
    top = n_positions - new_tokens
    out, c = [], 32
    while c < top:
        out.append(c)
        c *= 2
    return out + [top] if top >= 1 else out


def run_sweep(model_dir: Path, cfg: BenchConfig, new_tokens: int = 8, log=None) -> list[dict[str, float]]:
    """Decode ms/token (median over `repeat` runs of `new_tokens`) at growing contexts."""
    log = log or sys.stderr
    work = Workload(Path(model_dir), cfg, fixed_lengths=False)
    rows = []
    contexts = sweep_contexts(work.lm.n_positions, new_tokens)
    for context in progress(contexts, "sweep", "context", log):
        work.run(context, new_tokens)  # warm-up at this size
        steps = []
        for _ in range(cfg.repeat):
            steps += work.run(context, new_tokens).decode_ms
        median = float(np.median(steps))
        rows.append({"context": context, "decode_ms_per_token": median, "decode_ms_per_token_median": median})
    return rows


def check_plotting() -> None:
    """Fail before any measurement when --plot cannot be honoured."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise GenerationError("--plot needs matplotlib: pip install 'gpt2edge[plot]'.")


def plot_sweep(rows: list[dict[str, float]], path: Path, title: str) -> None:
    """PNG of decode ms/token against context (needs the `plot` extra: matplotlib)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["context"] for r in rows], [r["decode_ms_per_token"] for r in rows], marker="o")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bench_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The human-readable table of a bench record."""
    rows = [
        ("model", f"{r['model']} ({r['precision']}, {r['kv_cache']} KV cache)"),
        (
            "workload",
            "batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, {repeat} runs".format(**r["config"]),
        ),
        (
            "prefill (time to first token)",
            f"{r['prefill_ms']:.1f} ms  ({r['prefill_vs_floor']:.2f} x FLOP floor; "
            f"best run {r['prefill_ms_best']:.1f} ms, {r['prefill_vs_floor_best']:.2f} x)",
        ),
        ("decode median / p90", f"{r['decode_ms_per_token']:.2f} / {r['decode_ms_p90']:.2f} ms/token"),
        ("tokens/s", f"{r['tokens_per_s']:.1f}"),
        ("sampler overhead", f"{r['sampler_ms_per_token']:.3f} ms/token"),
        ("peak RSS", f"{r['peak_rss_mb']:.0f} MB"),
        ("model bytes", f"{r['model_bytes'] / 1e6:.1f} MB"),
        ("bytes read per decode step", f"{r['bytes_read_per_step'] / 1e6:.1f} MB"),
        ("achieved bandwidth", f"{r['achieved_bandwidth_gbs']:.1f} GB/s"),
        (
            "machine read bandwidth (probe)",
            "{:.1f} GB/s (best; before/after the runs {:.1f}-{:.1f})".format(
                r["machine_read_bandwidth_gbs"], *r["machine_read_bandwidth_range_gbs"]
            ),
        ),
        ("decode floor / vs floor", _decode_floor_row(r)),
    ]
    if "torch" in r:
        t = r["torch"]
        rows += [
            ("PyTorch prefill / decode", f"{t['prefill_ms']:.1f} ms / {t['decode_ms_per_token']:.2f} ms/token"),
            ("speed-up vs PyTorch", f"prefill {t['prefill_speedup']:.2f} x, decode {t['decode_speedup']:.2f} x"),
        ]
    return rows


def _decode_floor_row(r: dict[str, Any]) -> str:
    if r["decode_vs_floor"] is None:
        return f"does not apply: {r['decode_floor_note']} (best run {r['decode_ms_best_run']:.2f} ms/token)"
    return (
        f"{r['decode_floor_ms']:.2f} ms  ({r['decode_vs_floor']:.2f} x floor; "
        f"best run {r['decode_ms_best_run']:.2f} ms/token, {r['decode_vs_floor_best_run']:.2f} x)"
    )
