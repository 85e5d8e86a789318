"""The `gpt2edge` command: parses arguments, calls the library, prints. Nothing else lives here.

Subpackages are imported inside each command so `gpt2edge generate` never imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import warnings
from pathlib import Path

import click

from gpt2edge import __version__
from gpt2edge.errors import Gpt2EdgeError
from gpt2edge.manifest import HEAD_MODES, KV_CACHE_MODES


def friendly_errors(fn):
    """Turn gpt2edge's typed errors into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Gpt2EdgeError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)

    return wrapper


def print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@click.group()
@click.version_option(__version__, prog_name="gpt2edge")
def main() -> None:
    """Export GPT-2-family models to ONNX, quantize them, and generate text on ONNX Runtime."""


@main.command()
@click.option("-m", "--model", "source", required=True, help="Local HF checkpoint folder (checked first) or hub id.")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--head",
    type=click.Choice(HEAD_MODES),
    default="last",
    show_default=True,
    help="last: next-token log-probs (generation); all: every position (scoring, perplexity); tail: the "
    "positions a logits_to_keep input lists (generation and speculative decoding's verify step).",
)
@click.option(
    "--kv-cache",
    type=click.Choice(KV_CACHE_MODES),
    default="concat",
    show_default=True,
    help="concat: Optimum's past/present contract; shared: the CPU fast path (cache updated in place).",
)
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset (18..23).")
@click.option("--validate/--no-validate", default=True, show_default=True, help="Compare with PyTorch after export.")
@click.option("--atol", type=float, default=1e-4, show_default=True, help="Validation tolerance (max abs diff).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option("--tokenizer", default=None, help="Take the tokenizer from this folder or hub id instead.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON on stdout.")
@friendly_errors
def export(source, out, head, kv_cache, opset, validate, atol, force, revision, tokenizer, as_json) -> None:
    """Export checkpoint -m SOURCE to the folder OUT (ONNX graph, tokenizer, configs, manifest)."""
    from gpt2edge.export import export_model

    result = export_model(
        source,
        out,
        head=head,
        kv_cache=kv_cache,
        opset=opset,
        run_validation=validate,
        atol=atol,
        force=force,
        revision=revision,
        tokenizer=tokenizer,
    )
    if as_json:
        print_json(result.manifest)
    else:
        size = sum(f["size"] for f in result.manifest["files"].values())
        click.echo(f"exported {source} -> {result.path} ({size / 1e6:.1f} MB)")


@main.command("random-checkpoint")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--size",
    type=click.Choice(["tiny", "mini", "small"]),
    default="tiny",
    show_default=True,
    help="tiny/mini for tests and demos; small is the real 124M GPT-2 shape.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--tokenizer", default=None, help="Folder with the tokenizer (vocab.json + merges.txt or tokenizer.json)."
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@friendly_errors
def random_checkpoint(out, size, seed, tokenizer, force) -> None:
    """Write a seeded random-weight GPT-2 HF checkpoint to OUT (offline stand-in for a real model)."""
    from gpt2edge.export import make_random_checkpoint

    make_random_checkpoint(out, size=size, seed=seed, tokenizer_dir=tokenizer, force=force)
    click.echo(f"wrote random-weight GPT-2 ({size}) checkpoint to {out}")


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option(
    "-p", "--prompt", "prompts", multiple=True, required=True, help="Prompt text; repeat for a left-padded batch."
)
@click.option("-n", "--max-new-tokens", type=int, default=None, help="Tokens to generate [default: 32].")
@click.option("--min-new-tokens", type=int, default=None, help="Suppress EOS until this many tokens.")
@click.option("--temperature", type=float, default=None, help="Sampling temperature; 0 = greedy.")
@click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens (0 = off) [default: 50].")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1] [default: 1.0].")
@click.option("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats [default: 1.0].")
@click.option("--greedy", is_flag=True, help="Greedy decoding even if the model's defaults sample.")
@click.option("--seed", type=int, default=None, help="Seed of the sampler (same seed, same tokens).")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); not included in the output.")
@click.option("--ignore-eos", is_flag=True, help="Keep going past the end-of-text token.")
@click.option("--truncate", is_flag=True, help="Keep the end of a prompt that does not fit instead of failing.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: ONNX Runtime's choice).")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files (large models).")
@click.option("--no-stream", is_flag=True, help="Print the text once it is complete.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (implies --no-stream).")
@click.option(
    "--draft",
    type=click.Path(path_type=Path),
    default=None,
    help="Speculative decoding with this draft model folder (same tokenizer, smaller model).",
)
@click.option(
    "--prompt-lookup",
    type=int,
    default=None,
    help="Speculative decoding with drafts copied from the context: the longest n-gram to match (e.g. 2).",
)
@click.option("--draft-tokens", type=int, default=None, help="Draft tokens per target step [default: adaptive].")
@friendly_errors
def generate(
    model_dir,
    prompts,
    max_new_tokens,
    min_new_tokens,
    temperature,
    top_k,
    top_p,
    repetition_penalty,
    greedy,
    seed,
    stop,
    ignore_eos,
    truncate,
    device,
    threads,
    no_verify,
    no_stream,
    as_json,
    draft,
    prompt_lookup,
    draft_tokens,
) -> None:
    """Generate text from the export folder MODEL_DIR (no PyTorch needed)."""
    from gpt2edge.runtime import Generator

    speculative = dict(draft=draft, prompt_lookup=prompt_lookup, draft_tokens=draft_tokens)
    with _warnings_to_stderr():
        gen = Generator(model_dir, device=device, threads=threads, verify=not no_verify, **speculative)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        do_sample=False if greedy else None,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        truncate=truncate,
    )
    if len(prompts) == 1 and not (no_stream or as_json):
        results: list = []
        pieces = gen.stream(prompts[0], result=results, **kwargs)  # raises on bad parameters, before output
        click.echo(prompts[0], nl=False)
        try:
            for piece in pieces:
                click.echo(piece, nl=False)
        except KeyboardInterrupt:
            click.echo("\n[interrupted]", err=True)
            return
        click.echo()
        _print_timings(results[0].timings, len(results[0].token_ids))
        return
    results = gen.generate(list(prompts), **kwargs)
    if as_json:
        objs = [{"prompt": p, **r.to_json()} for p, r in zip(prompts, results)]
        print_json(objs[0] if len(objs) == 1 else {"results": objs})
        return
    for p, r in zip(prompts, results):
        click.echo(p + r.text)
        click.echo(f"[finish: {r.finish_reason}]", err=True)
    _print_timings(results[0].timings, sum(len(r.token_ids) for r in results))


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="New export folder.")
@click.option("--mode", required=True, help="fp16, int8 or int4.")
@click.option("--block-size", type=int, default=None, help="Weights per scale along K [default: int8 128, int4 32].")
@click.option(
    "--accuracy-level",
    type=int,
    default=None,
    help="MatMulNBits compute type: 0 float, 4 int8 activations [default: 4, fastest on CPU].",
)
@click.option("--head-bits", type=int, default=None, help="Bits of the tied embedding/LM head [default: 8].")
@click.option("--keep-head-fp32", is_flag=True, help="Leave the embedding/LM head in fp32.")
@click.option(
    "--symmetric/--asymmetric",
    default=None,
    help="Codes without / with zero points [default: int4 symmetric (faster kernel), int8 asymmetric].",
)
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text file for the quality report [default: built-in English text].",
)
@click.option("--no-report", is_flag=True, help="Skip the quality report.")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the new manifest (with the report) as JSON.")
@friendly_errors
def quantize(
    model_dir,
    out,
    mode,
    block_size,
    accuracy_level,
    head_bits,
    keep_head_fp32,
    symmetric,
    text_file,
    no_report,
    force,
    as_json,
) -> None:
    """Write an fp16 / int8 / int4 variant of the export folder MODEL_DIR, with a quality report."""
    from gpt2edge.quantize import make_recipe, quantize_model

    recipe = make_recipe(mode, block_size, accuracy_level, head_bits, keep_head_fp32, symmetric)
    text = text_file.read_text() if text_file else None
    manifest = quantize_model(model_dir, out, recipe, force=force, text=text, report=not no_report)
    if as_json:
        print_json(manifest)
    else:
        q = manifest["quantization"]
        click.echo(
            f"wrote {out}: {q['size_after'] / 1e6:.1f} MB ({q['ratio'] * 100:.1f} % of {q['size_before'] / 1e6:.1f} MB)"
        )


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("other_dir", type=click.Path(path_type=Path), required=False)
@click.option("-m", "--model", "source", default=None, help="Compare MODEL_DIR with this PyTorch source instead.")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Tokens of the text to score.")
@click.option("--max-kl", type=float, default=None, help="Fail if mean KL(ref || variant) exceeds this.")
@click.option("--min-top1", type=float, default=None, help="Fail if top-1 agreement is below this (0..1).")
@click.option("--max-logprob-diff", type=float, default=None, help="Fail if max |Δ logprob| exceeds this.")
@click.option("--min-greedy-match", type=int, default=None, help="Fail if fewer greedy tokens match.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@friendly_errors
def parity(
    model_dir, other_dir, source, text_file, max_tokens, max_kl, min_top1, max_logprob_diff, min_greedy_match, as_json
) -> None:
    """Quality report of OTHER_DIR against MODEL_DIR (two export folders), or of MODEL_DIR against -m SOURCE."""
    from gpt2edge.errors import ValidationError
    from gpt2edge.quality import compare_folders, print_report, violations

    if (other_dir is None) == (source is None):
        raise click.UsageError("Give either a second export folder or -m SOURCE.")
    if max_tokens < 2:
        raise click.BadParameter("must be >= 2", param_hint="--max-tokens")
    text = text_file.read_text() if text_file else None
    if source is not None:
        from gpt2edge.export.reference import compare_with_source

        report = compare_with_source(model_dir, source, text=text, max_tokens=max_tokens)
    else:
        report = compare_folders(model_dir, other_dir, text=text, max_tokens=max_tokens)
    failed = violations(
        report, max_kl=max_kl, min_top1=min_top1, max_logprob_diff=max_logprob_diff, min_greedy_match=min_greedy_match
    )
    report["violations"] = failed
    if as_json:
        print_json(report)
    else:
        print_report(report, title=f"{report['variant']} vs {report['reference']}", file=sys.stdout)
    if failed:
        raise ValidationError("Parity thresholds exceeded: " + "; ".join(failed) + ".")


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--threads", type=int, default=None, help="Intra-op threads [default: ONNX Runtime's choice].")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--repeat", type=int, default=5, show_default=True, help="Timed runs after one warm-up.")
@click.option("--sweep", is_flag=True, help="Also measure decode ms/token at contexts 32 ... n_positions.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="With --sweep: write a PNG of ms/token against context (plot extra).",
)
@click.option("--vs-torch", is_flag=True, help="Also run the PyTorch source on the same workload.")
@click.option("-m", "--model", "source", default=None, help="PyTorch source for --vs-torch [default: manifest's].")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON on stdout.")
@click.option("--draft", type=click.Path(path_type=Path), default=None, help="Speculative vs plain, this draft.")
@click.option("--prompt-lookup", type=int, default=None, help="Speculative vs plain, prompt lookup (n-gram).")
@click.option("--draft-tokens", type=int, default=None, help="Draft tokens per target step [default: adaptive].")
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
    vs_torch,
    source,
    as_json,
    draft,
    prompt_lookup,
    draft_tokens,
    texts,
    sample,
) -> None:
    """Prefill / decode latency of MODEL_DIR, its bandwidth and FLOP floors, measured in one run."""
    if draft is not None or prompt_lookup is not None:
        if sweep or vs_torch:
            raise click.UsageError("--draft / --prompt-lookup cannot be combined with --sweep or --vs-torch.")
        from gpt2edge.bench.bench import BenchConfig
        from gpt2edge.bench.speculative import SpecBench

        cfg = BenchConfig(prompt_len, new_tokens, batch, threads, device, repeat)
        _bench_speculative(model_dir, cfg, SpecBench(draft, prompt_lookup, draft_tokens, tuple(texts), sample), as_json)
        return
    if texts or draft_tokens is not None or sample:
        raise click.UsageError("--text, --draft-tokens and --sample need --draft or --prompt-lookup.")
    from gpt2edge.bench.bench import (
        BenchConfig,
        bench_prompts,
        bench_rows,
        check_plotting,
        plot_sweep,
        run_bench,
        run_sweep,
    )

    cfg = BenchConfig(prompt_len, new_tokens, batch, threads, device, repeat)
    if plot is not None:
        if not sweep:
            raise click.UsageError("--plot needs --sweep.")
        check_plotting()
    record = run_bench(model_dir, cfg)
    if vs_torch:
        from gpt2edge.bench.torch_baseline import torch_bench
        from gpt2edge.manifest import read_manifest

        recorded = read_manifest(model_dir)["source"]
        prompts = bench_prompts(cfg, record["vocab_size"])
        t = torch_bench(source or recorded.get("path") or recorded["model"], prompts, new_tokens, repeat, threads)
        t["prefill_speedup"] = t["prefill_ms"] / record["prefill_ms"]
        t["decode_speedup"] = t["decode_ms_per_token"] / record["decode_ms_per_token"]
        record["torch"] = t
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
    for row in record.get("sweep", []):
        click.echo(f"{'context ' + str(row['context']):<32} {row['decode_ms_per_token']:.2f} ms/token")


def _bench_speculative(model_dir, cfg, spec, as_json: bool) -> None:
    """bench --draft / --prompt-lookup: speculative next to plain decoding (gpt2edge.bench.speculative)."""
    from gpt2edge.bench.speculative import run_spec_bench, spec_rows

    with _warnings_to_stderr():
        record = run_spec_bench(model_dir, cfg, spec)
    if as_json:
        print_json(record)
        return
    for name, value in spec_rows(record):
        click.echo(f"{name:<32} {value}")


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("text_file", default="-", type=click.File("rb"))
@click.option("--max-length", type=click.IntRange(min=2), default=None, help="Window length [default: n_positions].")
@click.option("--stride", type=click.IntRange(min=1), default=None, help="Window start step [default: max-length/2].")
@click.option(
    "--method",
    type=click.Choice(["auto", "head-all", "token-by-token"]),
    default="auto",
    show_default=True,
    help="auto: one pass per window on a --head all export, else token by token through the KV cache.",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--threads", type=click.IntRange(1, 1024), default=None, help="Intra-op threads.")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with per-token log-probs on stdout.")
@friendly_errors
def score(model_dir, text_file, max_length, stride, method, device, threads, no_verify, as_json) -> None:
    """Log-likelihood and perplexity of the text in TEXT_FILE (default: stdin) under MODEL_DIR."""
    from gpt2edge.errors import GenerationError
    from gpt2edge.runtime.model_folder import ModelFolder
    from gpt2edge.runtime.score import Scorer

    try:
        text = text_file.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerationError(f"{text_file.name} is not UTF-8 text ({e.reason} at byte {e.start}).") from e
    scorer = Scorer(ModelFolder.open(model_dir, verify=not no_verify), device=device, threads=threads)
    result = scorer.score(text, max_length=max_length, stride=stride, method=method)
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


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="New folder.")
@click.option(
    "--format",
    "fmt",
    required=True,
    help="ort: .ort graph + required_operators.config for minimal/mobile ONNX Runtime builds; "
    "genai: a folder onnxruntime-genai runs (genai_config.json).",
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the new manifest as JSON.")
@friendly_errors
def convert(model_dir, out, fmt, force, as_json) -> None:
    """Write the export folder MODEL_DIR in a deployment format (ORT format or onnxruntime-genai)."""
    from gpt2edge.convert import convert_folder

    manifest = convert_folder(model_dir, out, fmt, force=force)
    if as_json:
        print_json(manifest)
    else:
        size = sum(f["size"] for f in manifest["files"].values())
        click.echo(f"wrote {out} ({fmt}, {manifest['graph']['file']}, {size / 1e6:.1f} MB)")


def _print_timings(t: dict, n_tokens: int) -> None:
    click.echo(
        f"[{n_tokens} tokens | prefill {t['prefill_ms']:.1f} ms | decode {t['decode_ms_per_token_mean']:.2f} ms/token "
        f"(mean) | sampler {t['sampler_ms_per_token_mean']:.3f} ms/token | {t['tokens_per_s']:.1f} tokens/s]",
        err=True,
    )
    if "acceptance_rate" in t:  # speculative decoding: decode figures above are per target (verify) step
        click.echo(
            f"[speculative: {t['accepted_tokens']:.0f} of {t['draft_tokens']:.0f} draft tokens accepted "
            f"({t['acceptance_rate'] * 100:.0f} %) | {t['tokens_per_target_step']:.2f} tokens per target step | "
            f"{t['target_steps']:.0f} target steps | drafting {t['draft_ms_total']:.1f} ms]",
            err=True,
        )


@contextlib.contextmanager
def _warnings_to_stderr():
    """Library warnings (e.g. a draft model that is not smaller) as one `warning:` line each on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                click.echo(f"warning: {w.message}", err=True)


if __name__ == "__main__":
    main()
