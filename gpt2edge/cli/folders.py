"""Commands that write a model folder: export, random-checkpoint, quantize, convert, trim-vocab."""

from __future__ import annotations

from pathlib import Path

import click

from gpt2edge.cli.common import SEEDS, finite_range, friendly_errors, main, print_json, report_stream
from gpt2edge.cli.paths import OutputPath
from gpt2edge.convert import FORMATS
from gpt2edge.export.options import DEFAULT_ATOL, DEFAULT_OPSET, KV_DTYPE_CHOICES, SUPPORTED_OPSETS
from gpt2edge.export.random_checkpoint import SIZES
from gpt2edge.extras import require_extra
from gpt2edge.manifest.records import HEAD_MODES, KV_CACHE_MODES
from gpt2edge.prompt_input import read_text_file
from gpt2edge.quantize.handler import ACCURACY_LEVELS, HEAD_BITS, MODES
from gpt2edge.quantize.primitives import BLOCK_SIZES
from gpt2edge.quantize.targets import TARGET_CHOICES
from gpt2edge.report_text import choose_report_text


@main.command()
@click.option(
    "-m",
    "--model",
    "source",
    type=click.Path(),
    required=True,
    help="Local HF checkpoint folder (checked first) or hub id.",
)
@click.argument("out", type=OutputPath())
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
@click.option(
    "--kv-dtype",
    type=click.Choice(KV_DTYPE_CHOICES),
    default="fp32",
    show_default=True,
    help="The KV cache's dtype: fp16 halves it, int8 (static calibrated scales) quarters it.",
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
    "--atol",
    type=finite_range(min=0, min_open=True),
    default=DEFAULT_ATOL,
    show_default=True,
    help="Validation tolerance (max abs diff, > 0).",
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option(
    "--tokenizer", type=click.Path(), default=None, help="Take the tokenizer from this folder or hub id instead."
)
@click.option(
    "--static",
    metavar="BATCHxCHUNKxCAPACITY",
    default=None,
    help="Static shapes for NPUs (e.g. 1x64x1024): fixed prefill chunk and decode graphs, fixed-capacity cache.",
)
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A text from the model's domain, recorded in OUT: quantize, trim-vocab and parity score it by default.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON on stdout (the table on stderr).")
@friendly_errors
def export(
    source, out, head, kv_cache, kv_dtype, opset, validate, atol, force, revision, tokenizer, static, text_file, as_json
) -> None:
    """Export checkpoint -m SOURCE to the folder OUT (ONNX graph, tokenizer, configs, manifest).

    The validation table goes to stdout (stderr with --json)."""
    from gpt2edge.export import export_model

    result = export_model(
        source,
        out,
        head=head,
        kv_cache=kv_cache,
        kv_dtype=kv_dtype,
        opset=opset,
        run_validation=validate,
        atol=atol,
        force=force,
        revision=revision,
        tokenizer=tokenizer,
        static=static,
        log=report_stream(as_json),
        report_text=read_text_file(text_file) if text_file else None,
    )
    if as_json:
        print_json(result.manifest)
    else:
        size = sum(f["size"] for f in result.manifest["files"].values())
        click.echo(f"exported {source} -> {result.path} ({size / 1e6:.1f} MB)")


@main.command("random-checkpoint")
@click.argument("out", type=OutputPath())
@click.option(
    "--size",
    type=click.Choice(tuple(SIZES)),
    default="tiny",
    show_default=True,
    help="tiny/mini for tests and demos; small, medium, large, xl are the official GPT-2 shapes (124M..1.5B).",
)
@click.option("-s", "--seed", type=SEEDS, default=0, show_default=True, help="Seed of the random weights.")
@click.option(
    "--tokenizer",
    type=click.Path(),
    default=None,
    help="Folder with the tokenizer (vocab.json + merges.txt or tokenizer.json).",
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
@click.option("-o", "--output", "out", type=OutputPath(), required=True, help="New export folder.")
@click.option("--mode", type=click.Choice(MODES), required=True, help="Precision of the new folder.")
@click.option(
    "--block-size",
    type=click.Choice(BLOCK_SIZES),
    default=None,
    help="Weights per scale along K [default: the --target's, e.g. int8 128, int4 256, shrunk to divide every row].",
)
@click.option(
    "--accuracy-level",
    type=click.Choice(ACCURACY_LEVELS),
    default=None,
    help="MatMulNBits compute type: 0 float, 4 int8 activations [default: the --target's; 4 on x86].",
)
@click.option(
    "--head-bits", type=click.Choice(HEAD_BITS), default=None, help="Bits of the tied embedding/LM head [default: 8]."
)
@click.option("--keep-head-fp32", is_flag=True, help="Leave the embedding/LM head in fp32.")
@click.option(
    "--symmetric/--asymmetric",
    default=None,
    help="Codes without / with zero points [default: the --target's; asymmetric, avx2: symmetric int4].",
)
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text file for the quality report, 2 tokens or more; recorded in the new folder for later reports "
    "[default: the text MODEL_DIR records, else a built-in English sample].",
)
@click.option(
    "--target",
    type=click.Choice(TARGET_CHOICES),
    default="native",
    show_default=True,
    help="CPU whose recipe sets the defaults above; native: this machine's, found by running each instruction "
    "set (not from its flags). Any folder runs on any CPU.",
)
@click.option(
    "--kv-dtype",
    type=click.Choice(KV_DTYPE_CHOICES),
    default=None,
    help="The new folder's KV cache dtype [default: MODEL_DIR's; fp16 for --mode fp16].",
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
    target,
    kv_dtype,
    no_report,
    force,
    as_json,
) -> None:
    """Write an fp16 / int8 / int4 variant of the export folder MODEL_DIR, with a quality report.

    The report goes to stdout (stderr with --json)."""
    from gpt2edge.quantize import make_recipe, quantize_model

    require_extra("quantize", "quantize")
    recipe = make_recipe(mode, block_size, accuracy_level, head_bits, keep_head_fp32, symmetric, target=target)
    chosen = choose_report_text(text_file, [model_dir])
    log = report_stream(as_json)
    manifest = quantize_model(
        model_dir,
        out,
        recipe,
        force=force,
        text=chosen.text,
        report=not no_report,
        log=log,
        text_source=chosen.source,
        kv_dtype=kv_dtype,
    )
    if chosen.note and not no_report:  # under the report it qualifies
        click.echo(chosen.note, file=log)
    if as_json:
        print_json(manifest)
    else:
        q = manifest["quantization"]
        click.echo(
            f"wrote {out}: {q['size_after'] / 1e6:.1f} MB ({q['ratio'] * 100:.1f} % of {q['size_before'] / 1e6:.1f} MB)"
        )


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=OutputPath(), required=True, help="New folder.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    required=True,
    help="ort: .ort graph + required_operators.config for minimal/mobile ONNX Runtime builds; "
    "genai: a folder onnxruntime-genai runs (genai_config.json); web: a static web page that runs the model in "
    "the browser on onnxruntime-web (index.html; serve the folder).",
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the new manifest as JSON.")
@friendly_errors
def convert(model_dir, out, fmt, force, as_json) -> None:
    """Write the export folder MODEL_DIR in a deployment format (ORT format, onnxruntime-genai or a web page)."""
    from gpt2edge.convert import convert_folder

    manifest = convert_folder(model_dir, out, fmt, force=force)
    if as_json:
        print_json(manifest)
    else:
        size = sum(f["size"] for f in manifest["files"].values())
        click.echo(f"wrote {out} ({fmt}, {manifest['graph']['file']}, {size / 1e6:.1f} MB)")


@main.command("trim-vocab")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=OutputPath(), required=True, help="New export folder.")
@click.option(
    "--keep-from",
    "keep_from",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Text file or folder of text files: keep the tokens it uses (repeatable).",
)
@click.option(
    "--top", type=click.IntRange(min=1), default=None, help="With --keep-from: keep only the N most frequent of them."
)
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
    help="In-domain text for the quality report; recorded in the new folder for later reports [default: the text "
    "MODEL_DIR records, else a built-in English sample].",
)
@click.option("--max-tokens", type=click.IntRange(min=2), default=256, show_default=True, help="Tokens to score.")
@click.option("--no-report", is_flag=True, help="Skip the quality report.")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the new manifest (with the report) as JSON.")
@friendly_errors
def trim_vocab(model_dir, out, keep_from, top, keep_ids, text_file, max_tokens, no_report, force, as_json) -> None:
    """Write a variant of MODEL_DIR whose head scores only the kept tokens (always EOS and every single byte)."""
    from gpt2edge.trim.handler import trim_vocab as run_trim

    chosen = choose_report_text(text_file, [model_dir])
    log = report_stream(as_json)  # the report on stdout like every command's, stderr under --json
    manifest = run_trim(
        model_dir,
        out,
        keep_from=keep_from,
        top=top,
        keep_ids=keep_ids,
        force=force,
        text=chosen.text,
        max_tokens=max_tokens,
        report=not no_report,
        log=log,
        text_source=chosen.source,
    )
    if chosen.note and not no_report:  # under the report it qualifies
        click.echo(chosen.note, file=log)
    if as_json:
        print_json(manifest)
        return
    t, v = manifest["trim"], manifest["vocab"]
    before, after = t["decode_weight_bytes_before"], t["decode_weight_bytes_after"]
    click.echo(
        f"wrote {out}: keeps {v['kept']} of {v['full']} tokens; a decode step reads {after / 1e6:.1f} MB of weights "
        f"({before / 1e6:.1f} MB untrimmed); graph {t['size_after'] / 1e6:.1f} MB ({t['size_before'] / 1e6:.1f} MB)"
    )
