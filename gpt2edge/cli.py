"""The `gpt2edge` command: parses arguments, calls the library, prints. Nothing else lives here.

Subpackages are imported inside each command so `gpt2edge generate` never imports torch.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from gpt2edge import __version__
from gpt2edge.errors import Gpt2EdgeError


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
    type=click.Choice(["last", "all"]),
    default="last",
    show_default=True,
    help="last: next-token log-probs (generation); all: every position (scoring, perplexity).",
)
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset (18..23).")
@click.option("--validate/--no-validate", default=True, show_default=True, help="Compare with PyTorch after export.")
@click.option("--atol", type=float, default=1e-4, show_default=True, help="Validation tolerance (max abs diff).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option("--tokenizer", default=None, help="Take the tokenizer from this folder or hub id instead.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON on stdout.")
@friendly_errors
def export(source, out, head, opset, validate, atol, force, revision, tokenizer, as_json) -> None:
    """Export checkpoint -m SOURCE to the folder OUT (ONNX graph, tokenizer, configs, manifest)."""
    from gpt2edge.export import export_model

    result = export_model(
        source,
        out,
        head=head,
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
) -> None:
    """Generate text from the export folder MODEL_DIR (no PyTorch needed)."""
    from gpt2edge.runtime import Generator

    gen = Generator(model_dir, device=device, threads=threads, verify=not no_verify)
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


def _print_timings(t: dict, n_tokens: int) -> None:
    click.echo(
        f"[{n_tokens} tokens | prefill {t['prefill_ms']:.1f} ms | decode {t['decode_ms_per_token']:.2f} ms/token | "
        f"sampler {t['sampler_ms_per_token']:.3f} ms/token | {t['tokens_per_s']:.1f} tokens/s]",
        err=True,
    )


if __name__ == "__main__":
    main()
