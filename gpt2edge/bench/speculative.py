"""`gpt2edge bench --draft DIR` / `--prompt-lookup N`: speculative decoding next to plain decoding of the same
target, on the same prompts, greedy (so the two must give the same tokens, and the record says whether they
did) or, with --sample, bench's sampling (temperature 0.8, top-k 50, top-p 0.9: the same distribution, other
draws). Plain and speculative runs alternate, one warm-up of each first; figures are medians over the runs,
and the record keeps the load average before and after (on a shared host it says how busy the CPUs were).

The record also gives the target's read floor (bytes of a plain decode step / this machine's read bandwidth,
probed before and after the runs, as plain `bench` does), and both ms/token against it: a speculative
ms/token under the floor is what one-token-at-a-time decoding cannot reach. No floor when the step's bytes fit
in the last-level cache (the note says so).

Prompts: the first --prompt-len tokens of each --text file (acceptance depends on the text: code that reuses
its identifiers is what prompt lookup is for), else seeded random token ids (acceptance then means little).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gpt2edge.bench.bench import emulated_note, floor_note, kv_bytes_per_step
from gpt2edge.bench.probe import last_level_cache_bytes, read_bandwidth_gbs
from gpt2edge.bench.workload import SAMPLING, BenchConfig, bench_prompts
from gpt2edge.cpu_facts import this_cpu
from gpt2edge.errors import GenerationError
from gpt2edge.prompt_input import read_text_file
from gpt2edge.runtime.decoding.generate import GenerationState, generate
from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.generator import Generator
from gpt2edge.runtime.speculative.speculator import SpecState


@dataclass
class SpecBench:
    """What speculates: a draft folder or a prompt-lookup n-gram, and k (None: adaptive)."""

    draft: Path | None = None
    prompt_lookup: int | None = None
    draft_tokens: int | None = None
    texts: tuple[Path, ...] = ()
    sample: bool = False


def text_prompts(gen: Generator, texts: tuple[Path, ...], length: int) -> list[list[int]]:
    """The first `length` tokens of each text file."""
    prompts = []
    for path in texts:
        ids = gen.tokenizer.encode(read_text_file(path))  # its first MB: a huge or endless file is not read whole
        if len(ids) < length:
            raise GenerationError(f"{path} has {len(ids)} tokens, fewer than --prompt-len {length}.")
        prompts.append(ids[:length])
    return prompts


def _decode_ms_per_token(state: GenerationState) -> float:
    """Wall time after the prefill per token after the first (the first comes from the prefill)."""
    n = len(state.generated[0]) - 1
    return (state.wall_ms - state.prefill_ms) / max(n, 1)


def run_spec_bench(model_dir: Path, cfg: BenchConfig, spec: SpecBench, log=sys.stderr) -> dict[str, Any]:
    cfg.check_runs()
    if cfg.batch != 1:
        raise GenerationError("Speculative decoding runs batch 1; drop --batch.")
    gen = Generator(
        model_dir,
        device=cfg.device,
        threads=cfg.threads,
        verify=False,
        draft=spec.draft,
        prompt_lookup=spec.prompt_lookup,
        draft_tokens=spec.draft_tokens,
    )
    cfg = cfg.fitted(gen.lm.n_positions)  # defaults shrunk to fit the model, given lengths checked
    prompts = text_prompts(gen, spec.texts, cfg.prompt_len) if spec.texts else bench_prompts(cfg, gen.lm.vocab_size)
    sampling = SAMPLING if spec.sample else {}  # greedy by default; EOS ignored either way
    params = SamplingParams(max_new_tokens=cfg.new_tokens, seed=cfg.seed, **sampling)
    bandwidths = [read_bandwidth_gbs(cfg.threads or 2)]  # before and after the runs: a shared host drifts
    plain_ms, spec_ms, steps, mismatches = [], [], [], 0
    totals = {"drafted": 0, "accepted": 0, "emitted": 0, "target_steps": 0, "draft_ms": 0.0}
    load_before = os.getloadavg()
    for i in tqdm(range(cfg.repeat + 1), desc="bench", unit="round", file=log, leave=False, disable=None):
        for j, prompt in enumerate(prompts):
            order = ("plain", "spec") if (i + j) % 2 == 0 else ("spec", "plain")  # alternate who goes first
            runs = {kind: _run(gen, prompt, params, kind) for kind in order}
            if i == 0:
                continue  # warm-up round
            plain, sp = runs["plain"], runs["spec"]
            mismatches += plain.generated[0] != sp.generated[0]
            plain_ms.append(_decode_ms_per_token(plain))
            spec_ms.append(_decode_ms_per_token(sp))
            steps += sp.decode_ms
            for k in totals:
                totals[k] += getattr(sp.stats, k)
    bandwidths.append(read_bandwidth_gbs(cfg.threads or 2))
    plain_med, spec_med = float(np.median(plain_ms)), float(np.median(spec_ms))
    floor = _read_floor(gen, cfg, max(bandwidths))
    return {
        "model": str(model_dir),
        "precision": gen.folder.precision,
        "kv_cache": gen.folder.kv_cache,
        "head": gen.folder.head,
        "sampling": "bench sampling (temperature 0.8, top-k 50, top-p 0.9)" if spec.sample else "greedy",
        "drafter": f"draft model {spec.draft}" if spec.draft else f"prompt lookup (n-gram <= {spec.prompt_lookup})",
        "draft_tokens": spec.draft_tokens or "adaptive",
        "prompts": [str(t) for t in spec.texts] or "random token ids",
        "n_prompts": len(prompts),
        "config": asdict(cfg),
        "plain_ms_per_token": plain_med,
        "plain_ms_per_token_range": [min(plain_ms), max(plain_ms)],
        "plain_tokens_per_s": 1e3 / plain_med,
        "speculative_ms_per_token": spec_med,
        "speculative_ms_per_token_range": [min(spec_ms), max(spec_ms)],
        "speculative_tokens_per_s": 1e3 / spec_med,
        "speedup": plain_med / spec_med,
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
        "tokens_per_target_step": totals["emitted"] / totals["target_steps"] if totals["target_steps"] else 0.0,
        "draft_tokens_per_step": totals["drafted"] / totals["target_steps"] if totals["target_steps"] else 0.0,
        "verify_step_ms": float(np.median(steps)) if steps else 0.0,
        "draft_ms_per_step": totals["draft_ms"] / totals["target_steps"] if totals["target_steps"] else 0.0,
        **floor,
        "plain_vs_floor": plain_med / floor["decode_floor_ms"] if floor["decode_floor_ms"] else None,
        "speculative_vs_floor": spec_med / floor["decode_floor_ms"] if floor["decode_floor_ms"] else None,
        "machine_read_bandwidth_range_gbs": [min(bandwidths), max(bandwidths)],
        "greedy_identical": None if spec.sample else mismatches == 0,
        "runs": len(plain_ms),
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
    }


def _read_floor(gen: Generator, cfg: BenchConfig, bandwidth: float) -> dict[str, Any]:
    """The target's plain decode floor, as `bench` computes it: its weights once plus the past keys and values
    at the mean context, over the read bandwidth; None with a note when those bytes fit in the last-level cache
    (or the CPU is emulated)."""
    weights = gen.folder.manifest["graph"].get("decode_weight_bytes") or gen.folder.model_bytes()
    itemsize = np.dtype(gen.folder.kv_dtype).itemsize
    context = cfg.prompt_len + (cfg.new_tokens - 1) / 2
    kv = (1 if gen.lm.shared else 2) * kv_bytes_per_step(gen.folder.dims, 1, context, itemsize)
    cpu = this_cpu()
    llc = None if cpu.emulated else last_level_cache_bytes()
    note = emulated_note(cpu.emulated) or floor_note(weights + kv, llc)
    return {
        "weight_bytes_per_step": int(weights),
        "bytes_read_per_step": int(weights + kv),
        "machine_read_bandwidth_gbs": bandwidth,
        "last_level_cache_bytes": llc,
        "decode_floor_ms": None if note else (weights + kv) / (bandwidth * 1e9) * 1e3,
        "decode_floor_note": note,
    }


def _run(gen: Generator, prompt: list[int], params: SamplingParams, kind: str) -> GenerationState:
    """One greedy generation on the Generator's target context: plain, or speculative."""
    if kind == "plain":
        return generate(gen.lm, gen.tokenizer, [prompt], params, gen.pad_token_id)
    state = SpecState(prompts=[prompt], params=params)
    for _ in gen.speculator.iter_generate(gen.lm, gen.tokenizer, state):
        pass
    return state


def spec_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The human-readable table of a speculative bench record."""
    c = r["config"]
    return [
        ("model", f"{r['model']} ({r['precision']}, {r['kv_cache']} KV cache, head {r['head']})"),
        ("drafter", f"{r['drafter']}, k {r['draft_tokens']}"),
        (
            "workload",
            f"{r['sampling']}, prompt {c['prompt_len']} tokens ({r['n_prompts']} prompts), {c['new_tokens']} new",
        ),
        ("plain decode", f"{r['plain_ms_per_token']:.2f} ms/token ({r['plain_tokens_per_s']:.1f} tokens/s)"),
        (
            "speculative decode",
            f"{r['speculative_ms_per_token']:.2f} ms/token ({r['speculative_tokens_per_s']:.1f} tokens/s)",
        ),
        ("speed-up", f"{r['speedup']:.2f} x"),
        ("read floor", _floor_text(r)),
        ("acceptance rate", f"{r['acceptance_rate'] * 100:.1f} %"),
        ("tokens per target step", f"{r['tokens_per_target_step']:.2f} ({r['draft_tokens_per_step']:.2f} drafted)"),
        ("verify step", f"{r['verify_step_ms']:.2f} ms (median); drafting {r['draft_ms_per_step']:.2f} ms per step"),
        ("greedy tokens identical", {None: "n/a (sampling)", True: "yes", False: "NO"}[r["greedy_identical"]]),
        ("load average before / after", " / ".join(f"{a[0]:.1f}" for a in r["load_average_before_after"])),
    ]


def _floor_text(r: dict[str, Any]) -> str:
    if r.get("decode_floor_ms") is None:
        return r.get("decode_floor_note") or "n/a"
    return (
        f"{r['decode_floor_ms']:.2f} ms/token ({r['bytes_read_per_step'] / 1e6:.1f} MB at "
        f"{r['machine_read_bandwidth_gbs']:.1f} GB/s): plain {r['plain_vs_floor']:.2f} x, "
        f"speculative {r['speculative_vs_floor']:.2f} x the floor"
    )
