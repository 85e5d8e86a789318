"""Quality report: how far a variant's next-token distributions are from a reference, on a token stream.

Both sides are run token by token through the KV cache (the path generation uses). Metrics, over every
position of the stream: mean KL(reference || variant), top-1 agreement, max |delta log-prob| (whole vocab),
perplexity of each, and greedy agreement: both sides decode 64 greedy tokens from several points of the
stream (a divergence can start anywhere), and the report keeps the shortest run of matching tokens and where
it started. The reference is another export folder (fp32 parent) or, via gpt2edge.export.reference, the
PyTorch source model. No torch here: the runtime extra is enough.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gpt2edge.api_args import path_arg, text_arg
from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.heap import return_free_memory
from gpt2edge.manifest import load_manifest
from gpt2edge.quality.trimmed import compare_trimmed, print_trim_rows
from gpt2edge.runtime.decoding.generate import generate
from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.model.contract import LM
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.tokenizer import TextTokenizer
from gpt2edge.runtime.open_model import load_graph
from gpt2edge.sample_text import SAMPLE_TEXT

DEFAULT_MAX_TOKENS = 256
GREEDY_TOKENS = 64
GREEDY_PROMPT_TOKENS = 16  # the first (shortest) greedy prompt
GREEDY_STARTS = 4  # greedy decoding starts from this many points of the stream
# dims two folders must share to be compared position by position, token by token
COMPARABLE_DIMS = ("vocab_size", "n_positions")
CHUNK_ROWS = 32


def stream_tokens(tokenizer: TextTokenizer, text: str | None, n_positions: int, max_tokens: int) -> list[int]:
    """The scored stream: the text's tokens, cut to the context; at least 2 (each scores the next)."""
    ids = tokenizer.encode(text if text is not None else SAMPLE_TEXT)[: min(max_tokens, n_positions)]
    if len(ids) < 2:
        raise GenerationError(
            f"The --text has {len(ids)} token(s); the quality report needs at least 2 (it scores each next "
            "token). Pass a longer text, or leave --text out for the built-in one."
        )
    return ids


def check_report_text(model_dir: Path, text: str | None, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[int]:
    """Tokenize the report's text with the folder's tokenizer now, so a bad --text fails before any work."""
    folder = ModelFolder.open(model_dir, verify=False)
    return stream_tokens(
        TextTokenizer(folder.tokenizer_path, folder.dims.vocab_size), text, folder.dims["n_positions"], max_tokens
    )


def check_comparable(a: Path, b: Path) -> None:
    """Refuse two folders whose logprobs cannot be compared (another vocabulary or context), from the
    manifests alone: before any session is built."""
    da, db = load_manifest(a).dims, load_manifest(b).dims
    for key in COMPARABLE_DIMS:
        if da.get(key) != db.get(key):
            raise ModelFolderError(
                f"{a} and {b} are not variants of one model: {key} {da.get(key)} vs {db.get(key)}; "
                "compare an export with its own quantized variants."
            )


def greedy_plan(n_tokens: int, n_positions: int) -> tuple[list[int], int]:
    """Prompt lengths to start greedy decoding from (spread over the stream) and the tokens each decodes."""
    first = min(GREEDY_PROMPT_TOKENS, n_tokens)
    n_new = min(GREEDY_TOKENS, n_positions - first)
    last = max(first, min(n_tokens, n_positions - n_new))
    return sorted({round(float(x)) for x in np.linspace(first, last, GREEDY_STARTS)}), n_new


def stream_logprobs(lm: LM, tokens: Sequence[int], sink: BinaryIO | None = None) -> np.ndarray:
    """(T, V) log-probs of the token after each position, one cached step per token. With `sink` (a binary file
    open for reading and writing), each row is appended there as it is computed and the result is a read-only
    map of those rows: no (T, V) array is held while the session runs (gpt2-small's vocabulary: 51 MB)."""
    lm.start(1, len(tokens))
    shape = (len(tokens), lm.vocab_size)
    out = np.empty(shape, dtype=np.float32) if sink is None else None
    start = 0 if sink is None else sink.seek(0, 2)
    mask = np.ones((1, len(tokens)), dtype=np.int64)
    for t, tok in enumerate(tokens):
        lp = lm.forward(np.array([[tok]], np.int64), mask[:, : t + 1], np.array([[t]], np.int64))
        if out is not None:
            out[t] = lp[0]  # copy: the bound output buffer is reused by the next step
        else:
            sink.write(np.ascontiguousarray(lp[0], dtype="<f4").tobytes())
    if out is not None:
        return out
    sink.flush()
    return np.memmap(sink, dtype="<f4", mode="r", offset=start, shape=shape)  # pages read when the metrics read


def logprobs_spill(n_tokens: int, vocab_size: int) -> BinaryIO | None:
    """A scratch file (deleted when closed) for both sides' log-probs, or None where the temp directory lacks
    room for them (with a margin): the report then keeps them in memory, as it did before."""
    need = 2 * n_tokens * vocab_size * 4
    try:
        if shutil.disk_usage(tempfile.gettempdir()).free < 2 * need + (256 << 20):
            return None
        return tempfile.TemporaryFile(prefix="gpt2edge-logprobs-")
    except OSError:  # no usable temp directory
        return None


def greedy_continuation(lm: LM, tokenizer: TextTokenizer, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, do_sample=False)
    return generate(lm, tokenizer, [prompt], params, pad_id=0).generated[0]


def renormalised(lp: np.ndarray) -> np.ndarray:
    """Log-probs in float64 that sum to 1 to float64 precision (a float32 log_softmax is off by ~1e-7)."""
    lp = lp.astype(np.float64)
    top = lp.max(-1, keepdims=True)
    return lp - (top + np.log(np.exp(lp - top).sum(-1, keepdims=True)))


def _kl(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """KL(p || q) per row of two renormalised float64 log-prob matrices (see kl_divergence)."""
    p, q = np.exp(lp), np.exp(lq)
    with np.errstate(invalid="ignore", over="ignore"):
        d = lq - lp
        terms = np.where(d > 1, q - p - np.where(p > 0, p * d, 0.0), p * (np.expm1(d) - d))
    terms = np.where(p > 0, terms, q)  # p underflowed to 0: the term's limit is q
    return np.maximum(terms, 0.0).sum(-1)


def kl_divergence(ref_lp: np.ndarray, var_lp: np.ndarray) -> np.ndarray:
    """KL(ref || var) per row, in float64; >= 0 by construction, 0 for equal distributions.

    With both renormalised, KL = sum p (e^d - 1 - d), d = log q - log p (the added terms sum to 1 - 1 = 0).
    Each term is >= 0 (e^d >= 1 + d), so rounding cannot make the sum negative; the clamp removes only the
    last-bit rounding of single terms. Small d uses expm1 (no cancellation), large d the equal q - p - p d."""
    return _kl(renormalised(ref_lp), renormalised(var_lp))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens of two continuations agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stream_metrics(ref_lp: np.ndarray, var_lp: np.ndarray, tokens: Sequence[int]) -> dict[str, Any]:
    """KL, top-1, max |delta log-prob| and perplexities over the stream, in float64, CHUNK_ROWS rows at a time
    (a float64 pass over a whole 256 x 50,257 stream would take ~100 MB per array)."""
    T = len(tokens)
    targets = np.asarray(tokens[1:])
    kl, top1 = np.empty(T), np.empty(T, dtype=bool)
    nll_ref, nll_var = np.empty(T - 1), np.empty(T - 1)
    max_diff = 0.0
    for lo in range(0, T, CHUNK_ROWS):
        r, v = renormalised(ref_lp[lo : lo + CHUNK_ROWS]), renormalised(var_lp[lo : lo + CHUNK_ROWS])
        hi = lo + len(r)
        kl[lo:hi] = _kl(r, v)
        top1[lo:hi] = r.argmax(-1) == v.argmax(-1)
        max_diff = max(max_diff, float(np.abs(r - v).max()))
        scored = np.arange(lo, min(hi, T - 1))  # positions whose next token is in the stream
        nll_ref[scored] = -r[scored - lo, targets[scored]]
        nll_var[scored] = -v[scored - lo, targets[scored]]
    return {
        "tokens": T,
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_agreement": float(top1.mean()),
        "max_abs_logprob_diff": max_diff,
        "perplexity_reference": float(np.exp(nll_ref.mean())),
        "perplexity_variant": float(np.exp(nll_var.mean())),
    }


def compare(
    ref_lp: np.ndarray,
    var_lp: np.ndarray,
    tokens: Sequence[int],
    ref_greedy: Sequence[list[int]],
    var_greedy: Sequence[list[int]],
    starts: Sequence[int],
) -> dict[str, Any]:
    """The metrics from two (T, V) log-prob matrices over the same stream, and the greedy continuations of
    both sides from each prompt length in `starts` (ref_greedy[i] and var_greedy[i] start at starts[i])."""
    return {**stream_metrics(ref_lp, var_lp, tokens), **greedy_fields(ref_greedy, var_greedy, starts)}


def greedy_fields(
    ref_greedy: Sequence[list[int]], var_greedy: Sequence[list[int]], starts: Sequence[int]
) -> dict[str, Any]:
    """How far the two sides' greedy continuations agree, from each start; the worst start is the headline."""
    matches = [first_divergence(r, v) for r, v in zip(ref_greedy, var_greedy)]
    worst = int(np.argmin(matches))
    return {
        "greedy_match": matches[worst],  # the worst start's
        "greedy_tokens": len(ref_greedy[worst]),
        "greedy_match_start": int(starts[worst]),  # tokens of the text before the worst start's first token
        "greedy_matches": [{"start": int(s), "match": m} for s, m in zip(starts, matches)],
    }


def folder_side(
    path: Path,
    tokens: list[int] | None,
    text: str | None,
    max_tokens: int,
    device: str = "cpu",
    n_positions: int | None = None,
    sink: BinaryIO | None = None,
) -> tuple[list[int], np.ndarray, list[list[int]], list[int], ModelFolder]:
    """Log-probs over the stream and the greedy continuations (one per start) of one export folder, within
    `n_positions` (default: the folder's; both sides of a comparison must plan alike); returns (tokens,
    logprobs, greedy, starts, folder). `sink`: stream_logprobs'."""
    folder = ModelFolder.open(path, verify=False)
    n_positions = min(folder.n_positions, n_positions or folder.n_positions)  # a static export: its capacity
    tokenizer = TextTokenizer(folder.tokenizer_path, folder.dims.vocab_size)
    if tokens is None:  # before the session: a bad --text fails without any work
        tokens = stream_tokens(tokenizer, text, n_positions, max_tokens)
    # OrtLM, or StaticLM on a static-shape export; lean: an fp16 variant's session holds its fp16 weights, not
    # fp32 copies beside them (gpt2-large: 4.85 GB -> 1.89 GB), an fp32 one no packed copies; same graph computed
    lm = load_graph(folder, device=device, lean=True).new_lm()
    starts, n_new = greedy_plan(len(tokens), n_positions)
    greedy = []
    for s in starts:
        greedy.append(greedy_continuation(lm, tokenizer, tokens[:s], n_new))
        # each run's KV cache and buffers, freed, would otherwise stay in glibc's heap under the next run's and
        # the log-probs' (gpt2-small's fp32 side: +57 MB over four runs, the report's peak)
        return_free_memory()
    return tokens, stream_logprobs(lm, tokens, sink), greedy, starts, folder


def compare_folders(
    a: Path,
    b: Path,
    text: str | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    device: str = "cpu",
    variant_name: str | None = None,
) -> dict[str, Any]:
    """Report for export folder b against reference folder a (a's tokens feed both). `variant_name`: what
    the report calls b (quantize measures a temporary folder that is renamed into place afterwards)."""
    a, b = path_arg(a, "a"), path_arg(b, "b")  # a TypeError names a wrong type
    text = None if text is None else text_arg(text, "text")
    check_comparable(Path(a), Path(b))
    # one plan for both sides: a static-shape export holds fewer positions than the model has
    folders = [ModelFolder.open(p, verify=False) for p in (Path(a), Path(b))]
    limit = min(f.n_positions for f in folders)
    # each side's log-probs go to a scratch file as they are computed and are read back by the metrics once both
    # sessions are gone: the variant's session never runs beside the reference's (T, V) array
    spill = logprobs_spill(min(max_tokens, limit), folders[0].dims["vocab_size"])
    try:
        tokens, lp_a, greedy_a, starts, fa = folder_side(Path(a), None, text, max_tokens, device, limit, spill)
        _, lp_b, greedy_b, _, fb = folder_side(Path(b), tokens, text, max_tokens, device, limit, spill)
        if fa.info.vocab is not None or fb.info.vocab is not None:  # a trimmed head: compared on its kept ids
            report = compare_trimmed(lp_a, lp_b, tokens, fa.kept_ids(), fb.kept_ids())
            report.update(greedy_fields(greedy_a, greedy_b, starts))
        else:
            report = compare(lp_a, lp_b, tokens, greedy_a, greedy_b, starts)
    finally:
        if spill is not None:
            spill.close()
    report.update(
        reference=str(a),
        variant=variant_name or str(b),
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


def print_report(report: dict[str, Any], title: str = "quality", file=sys.stdout) -> None:
    """A small table of the report."""
    greedy = f"{report['greedy_match']} / {report['greedy_tokens']} tokens"
    if len(report.get("greedy_matches", [])) > 1:
        greedy += f" (worst of {len(report['greedy_matches'])} starts: after {report['greedy_match_start']} tokens)"
    rows = [
        ("tokens in stream", f"{report['tokens']}"),
        ("mean KL(ref || variant)", f"{report['mean_kl']:.3e}"),
        ("top-1 agreement", f"{report['top1_agreement'] * 100:.1f} %"),
        ("max |Δ logprob|", f"{report['max_abs_logprob_diff']:.3e}"),
        ("perplexity ref / variant", f"{report['perplexity_reference']:.3f} / {report['perplexity_variant']:.3f}"),
        ("greedy match", greedy),
    ]
    if report.get("text_scored"):  # which text: --text, one recorded in the folder, or the built-in sample
        rows.insert(0, ("text scored", str(report["text_scored"])))
    if "size_variant" in report and report.get("size_reference"):
        ratio = report["size_variant"] / report["size_reference"]
        rows.insert(0, ("file size", f"{report['size_variant'] / 1e6:.2f} MB ({ratio * 100:.1f} % of reference)"))
    print(f"{title}:", file=file)
    for k, v in rows:
        print(f"  {k:<26} {v}", file=file)
    if "trim_kl" in report:  # a vocabulary-trimmed variant (gpt2edge.quality.trimmed)
        print_trim_rows(report, file=file)
