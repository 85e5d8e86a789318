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
from gpt2edge.export.options import DEFAULT_ATOL, DEFAULT_OPSET, SUPPORTED_OPSETS
from gpt2edge.extras import require_extra
from gpt2edge.manifest import HEAD_MODES, KV_CACHE_MODES
from gpt2edge.prompt_input import FORMATS, read_text_file
from gpt2edge.quantize.handler import ACCURACY_LEVELS, HEAD_BITS, MODES
from gpt2edge.quantize.primitives import BLOCK_SIZES


def friendly_errors(fn):
    """Turn gpt2edge's typed errors into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Gpt2EdgeError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except MemoryError as e:  # e.g. numpy cannot allocate the KV cache of 10^7 beams
            click.echo(
                f"error: out of memory ({e or 'allocation failed'}); ask for less (fewer prompts, beams or samples, "
                "a smaller -n), or free memory.",
                err=True,
            )
            sys.exit(1)

    return wrapper


def print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def report_stream(as_json: bool):
    """Where a human report (validation table, quality report) goes: stdout, or stderr under --json, whose
    stdout is exactly one JSON document. Progress bars (on a terminal only) and errors go to stderr."""
    return sys.stderr if as_json else sys.stdout


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
    help="last: next-token log-probs (generation); all: every position (scoring, perplexity).",
)
@click.option(
    "--kv-cache",
    type=click.Choice(KV_CACHE_MODES),
    default="concat",
    show_default=True,
    help="concat: Optimum's past/present contract; shared: the CPU fast path (cache updated in place).",
)
@click.option(
    "--opset",
    type=click.IntRange(SUPPORTED_OPSETS.start, SUPPORTED_OPSETS.stop - 1),
    default=DEFAULT_OPSET,
    show_default=True,
    help="ONNX opset.",
)
@click.option("--validate/--no-validate", default=True, show_default=True, help="Compare with PyTorch after export.")
@click.option(
    "--atol", type=float, default=DEFAULT_ATOL, show_default=True, help="Validation tolerance (max abs diff, > 0)."
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option("--tokenizer", default=None, help="Take the tokenizer from this folder or hub id instead.")
@click.option(
    "--static",
    metavar="BATCHxCHUNKxCAPACITY",
    default=None,
    help="Static shapes for NPUs (e.g. 1x64x1024): fixed prefill chunk and decode graphs, fixed-capacity cache.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON on stdout (the table on stderr).")
@friendly_errors
def export(source, out, head, kv_cache, opset, validate, atol, force, revision, tokenizer, static, as_json) -> None:
    """Export checkpoint -m SOURCE to the folder OUT (ONNX graph, tokenizer, configs, manifest).

    The validation table goes to stdout (stderr with --json)."""
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
        static=static,
        log=report_stream(as_json),
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


def _cfg_default(value: object) -> str:
    return f"[default: the model's generation_config.json, else {value}]"


THREADS = click.IntRange(1, 1024)  # ONNX Runtime would try to start any number of threads
SEEDS = click.IntRange(0, 2**63 - 1)


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option(
    "-p",
    "--prompt",
    "prompts",
    multiple=True,
    help="Prompt text; repeat for a batch. '-' reads one prompt from stdin (one trailing newline dropped).",
)
@click.option(
    "-f",
    "--prompt-file",
    "prompt_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, allow_dash=True),
    help="Prompts from a UTF-8 file ('-': stdin), see --format; repeatable, after the -p prompts.",
)
@click.option(
    "--format",
    "file_format",
    type=click.Choice(FORMATS),
    default="auto",
    show_default=True,
    help='-f files. lines: one prompt per non-blank line. jsonl: one JSON object per non-blank line, its "prompt" '
    "string. auto: jsonl when every non-blank line is such an object, else lines.",
)
@click.option(
    "--sequential", is_flag=True, help="Generate the prompts one after another (each streamed), not as one batch."
)
@click.option(
    "-n",
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens to generate " + _cfg_default(32) + ".",
)
@click.option(
    "--min-new-tokens",
    type=click.IntRange(min=0),
    default=None,
    help="Suppress EOS until this many tokens " + _cfg_default(0) + ".",
)
@click.option(
    "--do-sample/--greedy",
    default=None,
    help="Sample the next token, or take the most likely one " + _cfg_default("greedy") + ". "
    "--temperature, --top-k, --top-p and --seed only act when sampling; given without it, a notice on stderr "
    "says they are ignored.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=None,
    help="Sampling temperature; 0 = greedy " + _cfg_default(1.0) + ".",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=None,
    help="Sample among the k most likely tokens; 0 = all " + _cfg_default(50) + ".",
)
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Sample in the smallest set of tokens holding this probability mass, in (0, 1] " + _cfg_default(1.0) + ".",
)
@click.option(
    "--repetition-penalty",
    type=float,
    default=None,
    help="> 1 discourages repeats, greedy or sampling " + _cfg_default(1.0) + ".",
)
@click.option(
    "--min-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Sample among tokens at least this fraction of the best one's probability " + _cfg_default("off") + ".",
)
@click.option(
    "--typical-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Locally typical sampling mass in (0, 1] " + _cfg_default(1.0) + ".",
)
@click.option(
    "--no-repeat-ngram-size",
    type=click.IntRange(min=0),
    default=None,
    help="Never repeat an n-gram of this size, greedy or sampling; 0 = off " + _cfg_default(0) + ".",
)
@click.option("--ban", multiple=True, help="Never generate this text (repeatable; also with a leading space).")
@click.option("--seed", type=SEEDS, default=None, help="Seed of the sampler: same seed, same tokens [default: random].")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); not included in the output.")
@click.option("--ignore-eos", is_flag=True, help="Keep going past the end-of-text token.")
@click.option("--truncate", is_flag=True, help="Keep the end of a prompt that does not fit instead of failing.")
@click.option(
    "--num-beams",
    type=int,
    default=None,
    help="Beam search with this many beams (1 = off) [default: the model's generation_config.json, else 1].",
)
@click.option(
    "--num-return-sequences",
    type=int,
    default=None,
    help="Sequences per prompt (<= --num-beams) [default: the model's generation_config.json, else 1].",
)
@click.option("--length-penalty", type=float, default=None, help="Beam score = logprob / len**this [default: 1.0].")
@click.option(
    "--early-stopping",
    type=click.Choice(["true", "false", "never"], case_sensitive=False),
    default=None,
    help="When beam search stops (transformers' early_stopping) [default: false].",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--threads", type=THREADS, default=None, help="Intra-op threads, 1..1024 [default: ONNX Runtime's choice]."
)
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files (large models).")
@click.option("--no-stream", is_flag=True, help="Print the text once it is complete.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (implies --no-stream).")
@click.option(
    "--logprobs",
    type=int,
    default=None,
    help="With --json: each token's log-prob and the N most likely (0 = the chosen token only).",
)
@click.option("-i", "--interactive", is_flag=True, help="Each line of stdin extends the context; /reset, /quit.")
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
    prompt_files,
    file_format,
    sequential,
    max_new_tokens,
    min_new_tokens,
    do_sample,
    temperature,
    top_k,
    top_p,
    repetition_penalty,
    min_p,
    typical_p,
    no_repeat_ngram_size,
    ban,
    seed,
    stop,
    ignore_eos,
    truncate,
    num_beams,
    num_return_sequences,
    length_penalty,
    early_stopping,
    device,
    threads,
    no_verify,
    no_stream,
    as_json,
    logprobs,
    interactive,
    draft,
    prompt_lookup,
    draft_tokens,
) -> None:
    """Generate text from the export folder MODEL_DIR (no PyTorch needed).

    One prompt streams; several run as one left-padded batch (--sequential: one after another). Ctrl-C stops,
    prints what was generated, says [interrupted] on stderr and exits with status 130.
    """
    from gpt2edge.prompt_input import collect_prompts
    from gpt2edge.runtime import Generator
    from gpt2edge.runtime.beam import search_params

    _check_generate_modes(prompts, prompt_files, as_json, no_stream, logprobs, interactive, truncate, sequential)
    _check_interactive_search(interactive, num_beams, num_return_sequences, length_penalty, early_stopping)
    try:
        # prompts are read and checked before the model is loaded
        read_stdin = lambda: sys.stdin.buffer.read()  # noqa: E731
        # -i without -p starts from an empty context (its turns come from stdin)
        texts = [] if interactive and not prompts else collect_prompts(prompts, prompt_files, file_format, read_stdin)
        speculative = dict(draft=draft, prompt_lookup=prompt_lookup, draft_tokens=draft_tokens)
        with _warnings_to_stderr():
            gen = Generator(model_dir, device=device, threads=threads, verify=not no_verify, **speculative)
        # the CLI always passes the mode: the folder's generation_config decides it unless a flag does
        sample = do_sample if do_sample is not None else gen.sampling_params().do_sample
        knobs = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, seed=seed)
        _note_ignored_knobs(sample, knobs)
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            min_p=min_p,
            typical_p=typical_p,
            no_repeat_ngram_size=no_repeat_ngram_size,
            ban=ban,
            do_sample=sample,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            truncate=truncate,
        )
        if interactive:
            from gpt2edge.interactive import run_interactive

            del kwargs["truncate"]  # a session drops its oldest tokens instead
            sys.exit(run_interactive(gen, texts[0] if texts else None, kwargs))
        # every prompt must fit before the first one is generated (--sequential would otherwise fail midway)
        params = gen.sampling_params(**{k: v for k, v in kwargs.items() if k != "truncate"})
        kwargs["logprobs"] = logprobs
        for text in texts:
            gen.encode_prompt(text, params.max_new_tokens, truncate)
        search = dict(  # beam search / several sequences per prompt: printed once complete
            num_beams=num_beams,
            num_return_sequences=num_return_sequences,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        stream = not (no_stream or as_json)
        # generation_config.json may ask for beams or several sequences too: Generator.generate follows it
        if search_params(gen.defaults, **search).expands:
            interrupted = _generate_search(gen, texts, {**kwargs, **search}, as_json)
        elif sequential or len(texts) == 1:
            interrupted = _generate_each(gen, texts, kwargs, stream, as_json)
        else:
            interrupted = _generate_batch(gen, texts, kwargs, as_json)
    except KeyboardInterrupt:
        interrupted = True
    if interrupted:
        click.echo("[interrupted]", err=True)
        sys.exit(130)  # the shell's code for SIGINT: scripts can tell an interrupted run from a finished one


def _note_ignored_knobs(sample: bool, knobs: dict) -> None:
    """Sampling options given while sampling is off: one line on stderr instead of silently switching modes."""
    given = [f"--{k.replace('_', '-')}" for k, v in knobs.items() if v is not None]
    if given and not sample:
        verb = "has" if len(given) == 1 else "have"
        click.echo(f"note: sampling is off (greedy): {', '.join(given)} {verb} no effect; add --do-sample.", err=True)


def _generate_each(gen, texts: list[str], kwargs: dict, stream: bool, as_json: bool) -> bool:
    """Each prompt on its own, streamed or printed; returns whether Ctrl-C stopped it."""
    results = []
    for text in texts:
        result = _stream_one(gen, text, kwargs) if stream else gen.generate(text, **kwargs)
        results.append(result)
        if not as_json and not stream:
            _print_result(text, result)
        if not as_json:
            _print_timings(result.timings, len(result.token_ids))
        if result.finish_reason == "interrupted":
            break
    if as_json:
        _print_json_results(texts, results)
    return any(r.finish_reason == "interrupted" for r in results)


def _stream_one(gen, text: str, kwargs: dict):
    """Print the prompt, then the generated text as it is decoded; returns the GenerationResult."""
    results: list = []
    pieces = gen.stream(text, result=results, **kwargs)  # raises on bad parameters, before output
    click.echo(text, nl=False)
    try:
        for piece in pieces:
            click.echo(piece, nl=False)
    finally:
        click.echo()  # end the line, also when Ctrl-C cut the stream
    return results[0]


def _generate_batch(gen, texts: list[str], kwargs: dict, as_json: bool) -> bool:
    """All prompts as one left-padded batch; returns whether Ctrl-C stopped it."""
    results = gen.generate(texts, **kwargs)
    if as_json:
        _print_json_results(texts, results)
    else:
        for text, r in zip(texts, results):
            _print_result(text, r)
        _print_timings(results[0].timings, sum(len(r.token_ids) for r in results))
    return any(r.finish_reason == "interrupted" for r in results)


def _generate_search(gen, texts: list[str], kwargs: dict, as_json: bool) -> bool:
    """Beam search or several sequences per prompt, one row per sequence (prompt by prompt, best first);
    returns whether Ctrl-C stopped it."""
    results = gen.generate(texts, **kwargs)
    # num_return_sequences > 1 gives a list per prompt
    rows = [(t, r) for t, res in zip(texts, results) for r in (res if isinstance(res, list) else [res])]
    if as_json:
        objs = [{"prompt": t, **r.to_json()} for t, r in rows]
        print_json(objs[0] if len(objs) == 1 else {"results": objs})
    else:
        for t, r in rows:
            _print_result(t, r)
        _print_timings(rows[0][1].timings, sum(len(r.token_ids) for _, r in rows))
    return any(r.finish_reason == "interrupted" for _, r in rows)


def _print_result(text: str, result) -> None:
    click.echo(text + result.text)
    score = "" if result.sequence_score is None else f", score {result.sequence_score:.4f}"
    click.echo(f"[finish: {result.finish_reason}{score}]", err=True)


def _print_json_results(texts: list[str], results: list) -> None:
    """One object for one prompt, else {"results": [...]} (shorter when Ctrl-C stopped a --sequential run)."""
    objs = [{"prompt": t, **r.to_json()} for t, r in zip(texts, results)]
    print_json(objs[0] if len(texts) == 1 else {"results": objs})


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="New export folder.")
@click.option("--mode", type=click.Choice(MODES), required=True, help="Precision of the new folder.")
@click.option(
    "--block-size",
    type=click.Choice(BLOCK_SIZES),
    default=None,
    help="Weights per scale along K [default: int8 128, int4 32].",
)
@click.option(
    "--accuracy-level",
    type=click.Choice(ACCURACY_LEVELS),
    default=None,
    help="MatMulNBits compute type: 0 float, 4 int8 activations [default: 4, fastest on CPU].",
)
@click.option(
    "--head-bits", type=click.Choice(HEAD_BITS), default=None, help="Bits of the tied embedding/LM head [default: 8]."
)
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
    help="Text file for the quality report, 2 tokens or more [default: built-in English text].",
)
@click.option("--no-report", is_flag=True, help="Skip the quality report.")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the new manifest (with the report) as JSON (the table on stderr)."
)
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
    """Write an fp16 / int8 / int4 variant of the export folder MODEL_DIR, with a quality report.

    The report goes to stdout (stderr with --json)."""
    from gpt2edge.quantize import make_recipe, quantize_model

    require_extra("quantize", "quantize")
    recipe = make_recipe(mode, block_size, accuracy_level, head_bits, keep_head_fp32, symmetric)
    text = read_text_file(text_file) if text_file else None
    manifest = quantize_model(
        model_dir, out, recipe, force=force, text=text, report=not no_report, log=report_stream(as_json)
    )
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
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text file to score, 2 tokens or more [default: built-in English text].",
)
@click.option(
    "--max-tokens", type=click.IntRange(min=2), default=256, show_default=True, help="Tokens of the text to score."
)
@click.option("--max-kl", type=float, default=None, help="Fail if mean KL(ref || variant) exceeds this.")
@click.option("--min-top1", type=float, default=None, help="Fail if top-1 agreement is below this (0..1).")
@click.option("--max-logprob-diff", type=float, default=None, help="Fail if max |Δ logprob| exceeds this.")
@click.option("--min-greedy-match", type=int, default=None, help="Fail if fewer greedy tokens match.")
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
    text = read_text_file(text_file) if text_file else None
    if source is not None:
        from gpt2edge.export.reference import compare_with_source

        report = compare_with_source(model_dir, source, text=text, max_tokens=max_tokens)
    else:
        report = compare_folders(model_dir, other_dir, text=text, max_tokens=max_tokens)
    failed = violations(
        report, max_kl=max_kl, min_top1=min_top1, max_logprob_diff=max_logprob_diff, min_greedy_match=min_greedy_match
    )
    report["violations"] = failed
    print_report(report, title=f"{report['variant']} vs {report['reference']}", file=report_stream(as_json))
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
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--threads", type=THREADS, default=None, help="Intra-op threads, 1..1024 [default: ONNX Runtime's choice]."
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="Timed runs after one warm-up."
)
@click.option("--sweep", is_flag=True, help="Also measure decode ms/token at contexts 32 ... n_positions.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
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
    if vs_torch:
        require_extra("export", "bench --vs-torch")  # before the ONNX Runtime runs, not after
    record = run_bench(model_dir, cfg)
    if vs_torch:
        from gpt2edge.bench.torch_baseline import torch_bench
        from gpt2edge.manifest import read_manifest

        recorded = read_manifest(model_dir)["source"]
        fitted = BenchConfig(**record["config"])  # the lengths run_bench measured (defaults fitted to the model)
        prompts = bench_prompts(fitted, record["vocab_size"])
        t = torch_bench(
            source or recorded.get("path") or recorded["model"], prompts, fitted.new_tokens, repeat, threads
        )
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


def _check_generate_modes(prompts, prompt_files, as_json, no_stream, logprobs, interactive, truncate, sequential):
    """Option combinations generate refuses, before the model is loaded."""
    if interactive and (
        len(prompts) > 1 or prompt_files or as_json or no_stream or logprobs is not None or truncate or sequential
    ):
        raise click.UsageError(
            "-i takes at most one -p and no -f, --json, --no-stream, --logprobs, --truncate or --sequential."
        )
    if interactive and prompts == ("-",):
        raise click.UsageError("-i reads its turns from stdin; give the first prompt as text, not '-'.")
    if logprobs is not None and not as_json:
        raise click.UsageError("--logprobs needs --json (the log-probs are part of the JSON output).")


def _check_interactive_search(interactive, num_beams, num_return_sequences, length_penalty, early_stopping):
    """A session continues one sequence: beam search options given with -i would be silently dropped."""
    given = dict(num_beams=num_beams, num_return_sequences=num_return_sequences, length_penalty=length_penalty,
                 early_stopping=early_stopping)  # fmt: skip
    names = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
    if interactive and names:
        raise click.UsageError(f"-i continues one sequence per turn; drop {', '.join(names)} (beam search and "
                               "several sequences run without -i).")  # fmt: skip


@main.command("trim-vocab")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="New export folder.")
@click.option(
    "--keep-from",
    "keep_from",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Text file or folder of text files: keep the tokens it uses (repeatable).",
)
@click.option("--top", type=int, default=None, help="With --keep-from: keep only the N most frequent of them.")
@click.option(
    "--keep-ids",
    type=click.Path(path_type=Path),
    default=None,
    help="File of token ids to keep (.npy, JSON array, or whitespace/comma separated); must include EOS.",
)
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="In-domain text for the quality report [default: built-in English text].",
)
@click.option("--max-tokens", type=click.IntRange(min=2), default=256, show_default=True, help="Tokens to score.")
@click.option("--no-report", is_flag=True, help="Skip the quality report.")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the new manifest (with the report) as JSON.")
@friendly_errors
def trim_vocab(model_dir, out, keep_from, top, keep_ids, text_file, max_tokens, no_report, force, as_json) -> None:
    """Write a variant of MODEL_DIR whose head scores only the kept tokens (always EOS and every single byte)."""
    from gpt2edge.trim.handler import trim_vocab as run_trim

    text = read_text_file(text_file) if text_file else None
    manifest = run_trim(
        model_dir,
        out,
        keep_from=keep_from,
        top=top,
        keep_ids=keep_ids,
        force=force,
        text=text,
        max_tokens=max_tokens,
        report=not no_report,
    )
    if as_json:
        print_json(manifest)
        return
    t, v = manifest["trim"], manifest["vocab"]
    before, after = t["decode_weight_bytes_before"], t["decode_weight_bytes_after"]
    click.echo(
        f"wrote {out}: keeps {v['kept']} of {v['full']} tokens; a decode step reads {after / 1e6:.1f} MB of weights "
        f"({before / 1e6:.1f} MB untrimmed); graph {t['size_after'] / 1e6:.1f} MB ({t['size_before'] / 1e6:.1f} MB)"
    )


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; 0.0.0.0 exposes the server.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: any free port, printed)."
)
@click.option("--model-name", default=None, help="Name in /v1/models and requests [default: the folder's name].")
@click.option("--max-batch", type=int, default=16, show_default=True, help="Rows (prompts x n) decoded together.")
@click.option("--max-queue", type=int, default=128, show_default=True, help="Requests waiting; more get 429.")
@click.option("--max-n", type=int, default=8, show_default=True, help="Largest n (choices) per request.")
@click.option("--max-body-kb", type=int, default=1024, show_default=True, help="Largest request body (413 past it).")
@click.option(
    "--batch-wait-ms",
    type=float,
    default=50.0,
    show_default=True,
    help="Longest wait for a new batch to fill (see README: Serve).",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: ONNX Runtime's choice).")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files (large models).")
@click.option("--ray", "use_ray", is_flag=True, help="Deploy on Ray Serve (extra `cluster`) instead of uvicorn.")
@click.option("--replicas", type=int, default=None, help="With --ray: replicas, each loading MODEL_DIR [default: 1].")
@click.option("--replica-cpus", type=float, default=1.0, show_default=True, help="With --ray: CPUs per replica.")
@click.option("--ray-address", default=None, help="With --ray: join this cluster (e.g. auto) [default: start one].")
@friendly_errors
def serve(
    model_dir,
    host,
    port,
    model_name,
    max_batch,
    max_queue,
    max_n,
    max_body_kb,
    batch_wait_ms,
    device,
    threads,
    no_verify,
    use_ray,
    replicas,
    replica_cpus,
    ray_address,
) -> None:
    """Serve MODEL_DIR over HTTP: OpenAI-compatible /v1/completions (batched, SSE streaming), /v1/models, /health."""
    from gpt2edge.serve import ServeConfig, require_extra

    if not use_ray and (replicas is not None or ray_address is not None):
        raise click.UsageError("--replicas and --ray-address need --ray.")
    if replicas is not None and replicas < 1:
        raise click.BadParameter("must be >= 1", param_hint="--replicas")
    name = model_name or Path(model_dir).resolve().name
    config = ServeConfig(name, max_batch, max_queue, max_n, max_body_kb * 1024, batch_wait_ms)
    ready = lambda url: click.echo(f"serving {name} on {url} (OpenAI API at {url}/v1; Ctrl-C stops)")
    if use_ray:
        if port == 0:
            raise click.BadParameter("Ray Serve needs a fixed port", param_hint="--port")
        require_extra("cluster")
        from gpt2edge.runtime import ModelFolder
        from gpt2edge.serve.ray_app import build_application, run_on_ray

        ModelFolder.open(model_dir, verify=not no_verify)  # a bad folder fails here, not in every replica
        app = build_application(
            model_dir,
            config,
            device=device,
            threads=threads,
            verify=not no_verify,
            num_replicas=replicas or 1,
            replica_cpus=replica_cpus,
        )
        run_on_ray(app, host, port, address=ray_address, on_ready=ready)
        return
    require_extra("serve")
    from gpt2edge.serve.server import local_app, serve_forever

    serve_forever(local_app(model_dir, config, device, threads, not no_verify), host, port, on_ready=ready)


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
