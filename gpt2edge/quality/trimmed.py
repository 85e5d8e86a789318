"""Quality report of a vocabulary-trimmed head against its untrimmed parent, on a token stream (numpy only).

A trimmed model gives probability 0 to every dropped token, so KL(full || trimmed) is infinite whenever the
full model puts any mass there; that number says nothing. The report separates the two things that matter:

- fidelity, on the kept ids: the reference restricted to the kept ids and renormalised against the trimmed
  graph's log-probs (mean_kl, max_abs_logprob_diff). Trimming changes nothing else, so this is ~1e-7 for an
  fp32 head; the keys are those of gpt2edge.quality's report, so its thresholds and table apply unchanged.
- the cost of trimming: the reference's probability mass on the kept ids per position (kept_mass_*), and
  trim_kl = mean -log(kept mass) = KL(trimmed || full), the exact divergence of an ideal trimmed model; plus
  coverage, the share of the text's next tokens that are kept (a dropped one has probability 0: perplexities
  are over the covered positions and `uncovered_tokens` counts the rest).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """Row-wise log-sum-exp of (T, n) float64 scores."""
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]


def _support(vocab_size: int, kept_ref: np.ndarray | None, kept_var: np.ndarray | None) -> np.ndarray:
    """Ids both sides score: the intersection of their kept sets (an untrimmed side keeps everything)."""
    sets = [k for k in (kept_ref, kept_var) if k is not None]
    out = np.arange(vocab_size)
    for k in sets:
        out = np.intersect1d(out, k)
    return out


def compare_trimmed(
    ref_lp: np.ndarray,
    var_lp: np.ndarray,
    tokens: Sequence[int],
    kept_ref: np.ndarray | None,
    kept_var: np.ndarray | None,
) -> dict[str, Any]:
    """The report from two (T, V) log-prob matrices (-inf on dropped ids) over the same stream. The greedy
    fields are gpt2edge.quality's, which joins them (this module imports nothing of gpt2edge: quality -> here)."""
    ref = ref_lp.astype(np.float64)
    var = var_lp.astype(np.float64)
    V = ref.shape[1]
    support = _support(V, kept_ref, kept_var)
    # both restricted to the common ids and renormalised there: what the trimmed graph is held to
    r = ref[:, support] - _logsumexp(ref[:, support])[:, None]  # (T, K)
    v = var[:, support] - _logsumexp(var[:, support])[:, None]
    kl = (np.exp(r) * (r - v)).sum(-1)  # (T,)
    # mass the reference puts on what the variant keeps: the price of trimming, per position
    var_ids = np.arange(V) if kept_var is None else kept_var
    log_mass = _logsumexp(ref[:, var_ids])  # (T,) <= 0
    nxt = np.asarray(tokens[1:], dtype=np.int64)
    rows = np.arange(len(nxt))
    covered = np.isfinite(var[rows, nxt]) & np.isfinite(ref[rows, nxt])

    def ppl(lp: np.ndarray) -> float:
        return float(np.exp(-lp[rows[covered], nxt[covered]].mean())) if covered.any() else float("nan")

    return {
        "tokens": len(tokens),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_agreement": float((ref.argmax(-1) == var.argmax(-1)).mean()),
        "max_abs_logprob_diff": float(np.abs(r - v).max()),
        "perplexity_reference": ppl(ref),
        "perplexity_variant": ppl(var),
        "compared_on": "kept ids (reference restricted and renormalised)",
        "kept": int(support.size),
        "kept_mass_mean": float(np.exp(log_mass).mean()),
        "kept_mass_min": float(np.exp(log_mass).min()),
        "trim_kl": float(-log_mass.mean()),
        "coverage": float(covered.mean()) if len(covered) else 1.0,
        "uncovered_tokens": int((~covered).sum()),
    }


def print_trim_rows(report: dict[str, Any], file=sys.stderr) -> None:
    """The rows a trimmed report adds to gpt2edge.quality.print_report's table."""
    rows = [
        ("compared on", f"{report['kept']} kept ids (reference renormalised over them)"),
        ("kept mass mean / min", f"{report['kept_mass_mean']:.4f} / {report['kept_mass_min']:.4f}"),
        ("KL(trimmed || full)", f"{report['trim_kl']:.3e} nats (the cost of dropping tokens)"),
        (
            "next tokens kept",
            f"{report['coverage'] * 100:.1f} % ({report['uncovered_tokens']} not kept; perplexities over the kept)",
        ),
    ]
    for k, v in rows:
        print(f"  {k:<26} {v}", file=file)
