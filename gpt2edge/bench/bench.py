"""`gpt2edge bench`: prefill and decode latency of an export folder next to this machine's floors, and its table.

The workload (gpt2edge.bench.workload) runs once to warm up, then `repeat` timed runs. Decode figures pool every
step of the timed runs: median (`decode_ms_per_token`, also named `decode_ms_per_token_median`), mean, p90.
Only numpy, onnxruntime and tokenizers are used.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.bench.probe import last_level_cache_bytes, matmul_gflops, read_bandwidth_gbs
from gpt2edge.bench.workload import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT_LEN, BenchConfig, Workload, progress
from gpt2edge.cpu_facts import this_cpu


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


def emulated_note(why: str | None) -> str | None:
    """The floor note of an emulated CPU (gpt2edge.cpu_facts: qemu-user on another architecture), else None."""
    if why is None:
        return None
    return f"emulated CPU ({why}): timings, bandwidth and caches are the host's under emulation, no speed figure"


def kv_bytes_per_step(dims: dict[str, Any], batch: int, context: float, itemsize: int) -> float:
    """Bytes of past keys and values a decode step at `context` positions reads (every layer, K and V)."""
    return 2 * dims["n_layer"] * batch * dims["n_head"] * context * dims["head_dim"] * itemsize


def prefill_flops(dims: dict[str, Any], batch: int, seq: int) -> float:
    """Matmul FLOPs of a prefill: the blocks at every position, causal attention, the head at the last."""
    C, L = dims["n_embd"], dims["n_layer"]
    per_token = 2 * (3 * C * C + C * C + 2 * C * dims["n_inner"])  # qkv, proj, mlp in+out
    attention = 2 * 2 * C * seq * (seq + 1) / 2  # QK^T and AV over the causal triangle
    return batch * (L * (seq * per_token + attention) + 2 * C * dims["vocab_size"])


def _timed_runs(work: Workload, cfg: BenchConfig, log) -> tuple[list, list, list, list, list]:
    """A warm-up, then cfg.repeat timed runs: prefill ms per run, decode and sampler ms per step, tokens/s per
    run, and each run's median decode step (the best run is the one a shared host disturbed least)."""
    prefill, decode, sampler, tps, run_decode_medians = [], [], [], [], []
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
    return prefill, decode, sampler, tps, run_decode_medians


def _bytes_per_step(work: Workload, cfg: BenchConfig) -> tuple[int, int]:
    """(weight bytes, weight + KV cache bytes) one decode step reads."""
    dims = work.folder.dims
    itemsize = np.dtype(work.folder.kv_dtype).itemsize
    weights = work.folder.manifest["graph"].get("decode_weight_bytes") or work.folder.model_bytes()
    mean_context = cfg.prompt_len + (cfg.new_tokens - 1) / 2
    # shared: the fused attention reads the valid slots once, in place; concat: Concat reads the past and
    # attention reads the present, twice the mean context
    kv_read = (1 if work.lm.shared else 2) * kv_bytes_per_step(dims, cfg.batch, mean_context, itemsize)
    if work.folder.graph.static is not None:  # every slot of every row: the blend reads past, writes present,
        kv_read = 3 * kv_bytes_per_step(dims, work.lm.batch, work.lm.n_positions, itemsize)  # attention reads it
    return weights, weights + kv_read


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

    prefill, decode, sampler, tps, run_decode_medians = _timed_runs(work, cfg, log)
    weights, step_bytes = _bytes_per_step(work, cfg)
    probes.append((read_bandwidth_gbs(threads), matmul_gflops()))
    bandwidths, gflops_runs = zip(*probes)
    decode_median = float(np.median(decode))
    bandwidth, gflops = max(bandwidths), max(gflops_runs)  # best of both probes, as each probe is a best-of
    cpu = this_cpu()
    # under an emulator (qemu-user) the caches, bandwidth and timings are the host's: no floor, no cache
    llc = None if cpu.emulated else last_level_cache_bytes()
    note = emulated_note(cpu.emulated) or floor_note(step_bytes, llc)
    floor_ms = None if note else step_bytes / (bandwidth * 1e9) * 1e3
    flops = prefill_flops(dims, cfg.batch, cfg.prompt_len)
    prefill_floor = flops / (gflops * 1e9) * 1e3
    return {
        "model": str(model_dir),
        "cpu": cpu.name,
        "cpu_emulated": cpu.emulated,  # why this CPU looks emulated, or null
        "precision": work.folder.precision,
        "kv_cache": work.folder.kv_cache,
        "kv_dtype": work.folder.graph.kv_dtype,
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


def bench_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The human-readable table of a bench record."""
    rows = [
        ("model", f"{r['model']} ({r['precision']}, {r['kv_cache']} KV cache in {r.get('kv_dtype', 'float32')})"),
        ("cpu", r.get("cpu") or "?"),
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
