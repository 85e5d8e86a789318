"""Quality report: how far a variant's next-token distributions are from a reference, on a token stream.

Both sides are run token by token through the KV cache (the path generation uses). Metrics, over every
position of the stream: mean KL(reference || variant), top-1 agreement, max |delta log-prob| (whole vocab),
perplexity of each, and how many of 64 greedy tokens match before the first divergence. The reference is
another export folder (fp32 parent) or, via gpt2edge.export.reference, the PyTorch source model.
No torch here: the runtime extra is enough.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.runtime.generate import generate
from gpt2edge.runtime.lm import OrtLM
from gpt2edge.runtime.model_folder import ModelFolder
from gpt2edge.runtime.sampling import SamplingParams
from gpt2edge.runtime.tokenizer import TextTokenizer
from gpt2edge.sample_text import SAMPLE_TEXT

DEFAULT_MAX_TOKENS = 256
GREEDY_TOKENS = 64
GREEDY_PROMPT_TOKENS = 16


def stream_tokens(tokenizer: TextTokenizer, text: str | None, n_positions: int, max_tokens: int) -> list[int]:
    ids = tokenizer.encode(text if text is not None else SAMPLE_TEXT)
    return ids[: min(max_tokens, n_positions)]


def stream_logprobs(lm: OrtLM, tokens: Sequence[int]) -> np.ndarray:
    """(T, V) log-probs of the token after each position, one cached step per token."""
    lm.start(1, len(tokens))
    out = np.empty((len(tokens), lm.vocab_size), dtype=np.float32)
    mask = np.ones((1, len(tokens)), dtype=np.int64)
    for t, tok in enumerate(tokens):
        lp = lm.forward(np.array([[tok]], np.int64), mask[:, : t + 1], np.array([[t]], np.int64))
        out[t] = lp[0]  # copy: the bound output buffer is reused by the next step
    return out


def greedy_continuation(lm: OrtLM, tokenizer: TextTokenizer, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, do_sample=False)
    return generate(lm, tokenizer, [prompt], params, pad_id=0).generated[0]


def compare(
    ref_lp: np.ndarray, var_lp: np.ndarray, tokens: Sequence[int], ref_greedy: list[int], var_greedy: list[int]
) -> dict[str, Any]:
    """The metrics from two (T, V) log-prob matrices over the same stream and two greedy continuations."""
    ref_lp = ref_lp.astype(np.float64)
    var_lp = var_lp.astype(np.float64)
    kl = (np.exp(ref_lp) * (ref_lp - var_lp)).sum(-1)  # (T,)
    nxt = np.asarray(tokens[1:])
    rows = np.arange(len(nxt))
    match = next(
        (i for i, (a, b) in enumerate(zip(ref_greedy, var_greedy)) if a != b), min(len(ref_greedy), len(var_greedy))
    )
    return {
        "tokens": len(tokens),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_agreement": float((ref_lp.argmax(-1) == var_lp.argmax(-1)).mean()),
        "max_abs_logprob_diff": float(np.abs(ref_lp - var_lp).max()),
        "perplexity_reference": float(np.exp(-ref_lp[rows, nxt].mean())),
        "perplexity_variant": float(np.exp(-var_lp[rows, nxt].mean())),
        "greedy_match": int(match),
        "greedy_tokens": len(ref_greedy),
    }


def folder_side(path: Path, tokens: list[int] | None, text: str | None, max_tokens: int, device: str = "cpu"):
    """Log-probs over the stream and the greedy continuation of one export folder."""
    folder = ModelFolder.open(path, verify=False)
    tokenizer = TextTokenizer(folder.tokenizer_path)
    lm = OrtLM(folder, device=device)
    if tokens is None:
        tokens = stream_tokens(tokenizer, text, lm.n_positions, max_tokens)
    prompt = tokens[:GREEDY_PROMPT_TOKENS]
    n_new = min(GREEDY_TOKENS, lm.n_positions - len(prompt))
    return tokens, stream_logprobs(lm, tokens), greedy_continuation(lm, tokenizer, prompt, n_new), folder


def compare_folders(
    a: Path, b: Path, text: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS, device: str = "cpu"
) -> dict[str, Any]:
    """Report for export folder b against reference folder a (same tokenizer assumed: a's tokens feed both)."""
    tokens, lp_a, greedy_a, fa = folder_side(Path(a), None, text, max_tokens, device)
    _, lp_b, greedy_b, fb = folder_side(Path(b), tokens, text, max_tokens, device)
    if lp_a.shape != lp_b.shape:
        from gpt2edge.errors import ModelFolderError

        raise ModelFolderError(f"{a} and {b} have different vocabularies ({lp_a.shape[1]} vs {lp_b.shape[1]}).")
    if fa.info.vocab is not None or fb.info.vocab is not None:  # a trimmed head: compared on its kept ids
        from gpt2edge.trim.report import compare_trimmed

        report = compare_trimmed(lp_a, lp_b, tokens, greedy_a, greedy_b, fa.kept_ids(), fb.kept_ids())
    else:
        report = compare(lp_a, lp_b, tokens, greedy_a, greedy_b)
    report.update(
        reference=str(a),
        variant=str(b),
        size_reference=fa.model_bytes(),
        size_variant=fb.model_bytes(),
        precision_reference=fa.precision,
        precision_variant=fb.precision,
    )
    return report


THRESHOLD_KEYS = {
    "max_kl": ("mean_kl", "<="),
    "min_top1": ("top1_agreement", ">="),
    "max_logprob_diff": ("max_abs_logprob_diff", "<="),
    "min_greedy_match": ("greedy_match", ">="),
}


def violations(report: dict[str, Any], **thresholds: float | None) -> list[str]:
    """Each stated threshold the report misses, as a sentence; [] when all hold."""
    out = []
    for name, limit in thresholds.items():
        if limit is None:
            continue
        key, op = THRESHOLD_KEYS[name]
        value = report[key]
        ok = value <= limit if op == "<=" else value >= limit
        if not ok:
            out.append(f"{key} = {value:.4g} is not {op} {limit:g}")
    return out


def print_report(report: dict[str, Any], title: str = "quality", file=sys.stderr) -> None:
    """A small table of the report."""
    rows = [
        ("tokens in stream", f"{report['tokens']}"),
        ("mean KL(ref || variant)", f"{report['mean_kl']:.3e}"),
        ("top-1 agreement", f"{report['top1_agreement'] * 100:.1f} %"),
        ("max |Δ logprob|", f"{report['max_abs_logprob_diff']:.3e}"),
        ("perplexity ref / variant", f"{report['perplexity_reference']:.3f} / {report['perplexity_variant']:.3f}"),
        ("greedy match", f"{report['greedy_match']} / {report['greedy_tokens']} tokens"),
    ]
    if "size_variant" in report and report.get("size_reference"):
        ratio = report["size_variant"] / report["size_reference"]
        rows.insert(0, ("file size", f"{report['size_variant'] / 1e6:.2f} MB ({ratio * 100:.1f} % of reference)"))
    print(f"{title}:", file=file)
    for k, v in rows:
        print(f"  {k:<26} {v}", file=file)
    if "trim_kl" in report:  # a vocabulary-trimmed variant (gpt2edge.trim.report)
        from gpt2edge.trim.report import print_trim_rows

        print_trim_rows(report, file=file)
