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


if __name__ == "__main__":
    main()
