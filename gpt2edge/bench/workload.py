"""What `gpt2edge bench` runs: its config, the seeded prompts, and the loaded model that generates them.

Workload: `batch` prompts of `prompt_len` seeded random token ids, `new_tokens` sampled tokens each
(temperature 0.8, top-k 50, top-p 0.9; EOS ignored). Lengths left to their defaults (128 + 128) shrink to fit a
model with fewer positions. Shared by the bench, the sweep, and the beam and speculative benches. Only numpy,
onnxruntime and tokenizers are used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt2edge.errors import GenerationError
from gpt2edge.runtime.decoding.generate import generate
from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.tokenizer import TextTokenizer
from gpt2edge.runtime.open_model import load_graph

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
        self.tokenizer = TextTokenizer(self.folder.tokenizer_path, self.folder.dims.vocab_size)

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
