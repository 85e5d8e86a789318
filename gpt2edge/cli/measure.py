"""Commands that measure a folder: parity, bench, score."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gpt2edge.cli.common import (
    DEVICE_HELP,
    DEVICES,
    FULL_VERIFY_HELP,
    THREADS,
    THREADS_HELP,
    finite_range,
    friendly_errors,
    main,
    print_json,
    report_stream,
    verify_mode,
    warnings_to_stderr,
)
from gpt2edge.cli.paths import OutputPath
from gpt2edge.cli.thresholds import print_thresholds, threshold_checks
from gpt2edge.extras import require_extra
from gpt2edge.report_text import choose_report_text
from gpt2edge.runtime.score import METHODS


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("other_dir", type=click.Path(path_type=Path), required=False)
@click.option(
    "-m",
    "--model",
    "source",
    type=click.Path(),
    default=None,
    help="Compare MODEL_DIR with this PyTorch source instead.",
)
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text file to score, 2 tokens or more [default: the text the folders record (quantize/trim-vocab --text), "
    "else a built-in English sample].",
)
@click.option(
    "--max-tokens", type=click.IntRange(min=2), default=256, show_default=True, help="Tokens of the text to score."
)
@click.option("--max-kl", type=finite_range(min=0), default=None, help="Fail if mean KL(ref || variant) exceeds this.")
@click.option("--min-top1", type=finite_range(0, 1), default=None, help="Fail if top-1 agreement is below this (0..1).")
@click.option(
    "--max-logprob-diff", type=finite_range(min=0), default=None, help="Fail if max |Δ logprob| exceeds this."
)
@click.option("--min-greedy-match", type=click.IntRange(min=0), default=None, help="Fail if fewer greedy tokens match.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (the table on stderr).")
@friendly_errors
def parity(
    model_dir, other_dir, source, text_file, max_tokens, max_kl, min_top1, max_logprob_diff, min_greedy_match, as_json
) -> None:
    """Quality report of OTHER_DIR against MODEL_DIR (two export folders), or of MODEL_DIR against -m SOURCE.

    The report goes to stdout (stderr with --json)."""
    from gpt2edge.errors import ValidationError
    from gpt2edge.quality import compare_folders, print_report, violations

    if (other_dir is None) == (source is None):
        raise click.UsageError("Give either a second export folder or -m SOURCE.")
    if source is not None:
        require_extra("export", "parity -m")
    chosen = choose_report_text(text_file, [other_dir, model_dir] if other_dir is not None else [model_dir])
    if source is not None:
        from gpt2edge.export.reference import compare_with_source

        report = compare_with_source(model_dir, source, text=chosen.text, max_tokens=max_tokens)
    else:
        report = compare_folders(model_dir, other_dir, text=chosen.text, max_tokens=max_tokens)
    report["text_scored"] = chosen.source
    limits = dict(max_kl=max_kl, min_top1=min_top1, max_logprob_diff=max_logprob_diff)
    limits["min_greedy_match"] = min_greedy_match
    failed = violations(report, **limits)
    report["violations"] = failed
    report["thresholds"] = threshold_checks(report, limits)
    log = report_stream(as_json)
    print_report(report, title=f"{report['variant']} vs {report['reference']}", file=log)
    print_thresholds(report["thresholds"], file=log)
    if chosen.note:
        click.echo(chosen.note, file=log)
    if as_json:
        print_json(report)
    if failed:
        raise ValidationError("Parity thresholds exceeded: " + "; ".join(failed) + ".")


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option(
    "--prompt-len",
    type=click.IntRange(min=1),
    default=None,
    help="Prompt tokens [default: 128; on a model with fewer than 256 positions, half of them].",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=2),
    default=None,
    help="Generated tokens [default: 128, or the positions the prompt leaves]. Values you give must fit.",
)
@click.option(
    "--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Prompts decoded together (batch rows)."
)
@click.option("-t", "--threads", type=THREADS, default=None, help=THREADS_HELP)
@click.option("--device", type=DEVICES, default="cpu", show_default=True, help=DEVICE_HELP)
@click.option(
    "--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="Timed runs after one warm-up."
)
@click.option("--sweep", is_flag=True, help="Also measure decode ms/token at contexts 32 ... n_positions.")
@click.option(
    "--plot",
    type=OutputPath(dir_okay=False),
    default=None,
    help="With --sweep: write a PNG of ms/token against context (plot extra).",
)
@click.option(
    "--num-beams",
    "beam_widths",
    type=click.IntRange(min=1),
    multiple=True,
    help="Also time beam search at this width (repeatable: --num-beams 1 --num-beams 4): ms/token, cache reorder.",
)
@click.option("--vs-torch", is_flag=True, help="Also run the PyTorch source on the same workload.")
@click.option(
    "-m",
    "--model",
    "source",
    type=click.Path(),
    default=None,
    help="PyTorch source for --vs-torch [default: manifest's].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON on stdout.")
@click.option("--draft", type=click.Path(path_type=Path), default=None, help="Speculative vs plain, this draft.")
@click.option(
    "--prompt-lookup", type=click.IntRange(min=1), default=None, help="Speculative vs plain, prompt lookup (n-gram)."
)
@click.option(
    "--draft-tokens", type=click.IntRange(min=1), default=None, help="Draft tokens per target step [default: adaptive]."
)
@click.option(
    "--text",
    "texts",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --draft/--prompt-lookup: a prompt file (its first --prompt-len tokens); repeatable.",
)
@click.option("--sample", is_flag=True, help="With --draft/--prompt-lookup: bench's sampling instead of greedy.")
@friendly_errors
def bench(
    model_dir,
    prompt_len,
    new_tokens,
    batch,
    threads,
    device,
    repeat,
    sweep,
    plot,
    beam_widths,
    vs_torch,
    source,
    as_json,
    draft,
    prompt_lookup,
    draft_tokens,
    texts,
    sample,
) -> None:
    """Prefill / decode latency of MODEL_DIR, its bandwidth and FLOP floors, measured in one run.

    decode ms/token is the median over every decode step of the timed runs (--json: decode_ms_per_token and
    decode_ms_per_token_median; decode_ms_per_token_mean is the mean `generate` reports).
    """
    if draft is not None or prompt_lookup is not None:
        if sweep or vs_torch or beam_widths:
            raise click.UsageError("--draft / --prompt-lookup do not combine with --sweep, --vs-torch or --num-beams.")
        from gpt2edge.bench.speculative import SpecBench
        from gpt2edge.bench.workload import BenchConfig

        cfg = BenchConfig(prompt_len, new_tokens, batch, threads, device, repeat)
        _bench_speculative(model_dir, cfg, SpecBench(draft, prompt_lookup, draft_tokens, tuple(texts), sample), as_json)
        return
    if texts or draft_tokens is not None or sample:
        raise click.UsageError("--text, --draft-tokens and --sample need --draft or --prompt-lookup.")
    from gpt2edge.bench.bench import bench_rows, run_bench
    from gpt2edge.bench.sweep import check_plotting, plot_sweep, run_sweep
    from gpt2edge.bench.workload import BenchConfig, bench_prompts

    cfg = BenchConfig(prompt_len, new_tokens, batch, threads, device, repeat)
    if plot is not None:
        if not sweep:
            raise click.UsageError("--plot needs --sweep.")
        check_plotting()
    if vs_torch:
        require_extra("export", "bench --vs-torch")  # before the ONNX Runtime runs, not after
        source = source or _recorded_source(model_dir)
    record = run_bench(model_dir, cfg)
    if vs_torch:
        from gpt2edge.bench.torch_baseline import torch_bench

        fitted = BenchConfig(**record["config"])  # the lengths run_bench measured (defaults fitted to the model)
        prompts = bench_prompts(fitted, record["vocab_size"])
        t = torch_bench(source, prompts, fitted.new_tokens, repeat, threads)
        t["decode_ms_per_token_median"] = t["decode_ms_per_token"]  # torch_bench reports the median too
        t["prefill_speedup"] = t["prefill_ms"] / record["prefill_ms"]
        t["decode_speedup"] = t["decode_ms_per_token"] / record["decode_ms_per_token"]
        record["torch"] = t
    if beam_widths:
        from gpt2edge.bench.beams import beam_rows, run_beam_bench

        beams = run_beam_bench(model_dir, cfg, sorted(set(beam_widths)))
        record["beam_search"] = [r.to_json() for r in beams]
    if sweep:
        record["sweep"] = run_sweep(model_dir, cfg)
        if plot is not None:
            plot_sweep(record["sweep"], plot, f"{Path(model_dir).name} ({record['precision']}) decode")
            record["plot"] = str(plot)
    if as_json:
        print_json(record)
        return
    for k, v in bench_rows(record):
        click.echo(f"{k:<32} {v}")
    if beam_widths:
        for k, v in beam_rows(beams):
            click.echo(f"{k:<32} {v}")
    for row in record.get("sweep", []):
        click.echo(f"{'context ' + str(row['context']):<32} {row['decode_ms_per_token']:.2f} ms/token (median)")


def _terminal_stdin(f) -> bool:
    """Whether `f` is stdin and stdin is a terminal (someone typing, not a pipe or a file)."""
    try:
        return f.fileno() == 0 and f.isatty()
    except (OSError, ValueError, AttributeError):  # a stream with no file descriptor (e.g. a test's)
        return False


def _recorded_source(model_dir: Path) -> str:
    """The PyTorch source the manifest records (its local path first), or an error asking for -m."""
    from gpt2edge.errors import ModelFolderError
    from gpt2edge.manifest import load_manifest

    recorded = load_manifest(model_dir).raw.get("source") or {}
    found = recorded.get("path") or recorded.get("model")
    if not found:
        raise ModelFolderError(f"{model_dir}: the manifest records no source model; pass -m SOURCE with --vs-torch.")
    return found


def _bench_speculative(model_dir, cfg, spec, as_json: bool) -> None:
    """bench --draft / --prompt-lookup: speculative next to plain decoding (gpt2edge.bench.speculative)."""
    from gpt2edge.bench.speculative import run_spec_bench, spec_rows

    with warnings_to_stderr():
        record = run_spec_bench(model_dir, cfg, spec)
    if as_json:
        print_json(record)
        return
    for name, value in spec_rows(record):
        click.echo(f"{name:<32} {value}")


class _WindowProgress:
    """Scorer's progress callback as gpt2edge.progress.Progress, made at the first window (the total known)."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if total < 2:
                return  # one window: nothing to follow
            from gpt2edge.progress import Progress

            self.bar = Progress(total, "score", unit="window", file=sys.stderr, lines=10)
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> _WindowProgress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


_SCORE_HINT = "score a part of it (e.g. head -c 10M FILE | gpt2edge score MODEL_DIR)."


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("text_file", default="-", type=click.File("rb"))
@click.option("--max-length", type=click.IntRange(min=2), default=None, help="Window length [default: n_positions].")
@click.option("--stride", type=click.IntRange(min=1), default=None, help="Window start step [default: max-length/2].")
@click.option(
    "--method",
    type=click.Choice(METHODS),
    default="auto",
    show_default=True,
    help="auto: one pass per window on a --head all export, else token by token through the KV cache.",
)
@click.option("--device", type=DEVICES, default="cpu", show_default=True, help=DEVICE_HELP)
@click.option("-t", "--threads", type=THREADS, default=None, help=THREADS_HELP)
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files.")
@click.option("--verify", "full_verify", is_flag=True, help=FULL_VERIFY_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with per-token log-probs on stdout.")
@friendly_errors
def score(model_dir, text_file, max_length, stride, method, device, threads, no_verify, full_verify, as_json) -> None:
    """Log-likelihood and perplexity of the text in TEXT_FILE (default: stdin) under MODEL_DIR."""
    from gpt2edge.budget.inputs import MAX_SCORE_BYTES, read_limited
    from gpt2edge.errors import GenerationError
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.score import Scorer

    if _terminal_stdin(text_file):  # a bare `gpt2edge score DIR` would seem to hang
        click.echo("reading the text to score from stdin (end it with Ctrl-D), or pass a file: score DIR FILE.",
                   err=True)  # fmt: skip
    try:
        name = getattr(text_file, "name", "<stdin>")
        what = "stdin" if name in ("<stdin>", "-") else str(name)
        text = read_limited(text_file, MAX_SCORE_BYTES, what, _SCORE_HINT).decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerationError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start}).") from e
    folder = ModelFolder.open(model_dir, verify=verify_mode(no_verify, full_verify))
    scorer = Scorer(folder, device=device, threads=threads)
    # windows done, on stderr (stdout stays the result): a bar on a terminal, else a line per tenth
    with _WindowProgress() as progress:
        result = scorer.score(text, max_length=max_length, stride=stride, method=method, progress=progress)
    if as_json:
        print_json(result.to_json())
        return
    click.echo(f"tokens          {result.tokens} ({result.scored_tokens} scored, {result.windows} window(s))")
    click.echo(f"log-likelihood  {result.log_likelihood:.4f} nats")
    click.echo(f"mean NLL        {result.mean_nll:.4f} nats/token")
    click.echo(f"perplexity      {result.perplexity:.4f}")
    click.echo(
        f"method          {result.method} (max_length {result.max_length}, stride {result.stride}; "
        f"{result.tokens_per_s:.0f} tokens/s)"
    )
