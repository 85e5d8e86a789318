"""`gpt2edge sparse-head`: write the certified sparse-head variant of an export folder."""

from __future__ import annotations

from pathlib import Path

import click

from gpt2edge.cli.common import friendly_errors, main, print_json


@main.command("sparse-head")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="New export folder.")
@click.option(
    "--rank",
    type=click.IntRange(min=1),  # the model's bound (below n_embd) is checked with the folder
    default=16,
    show_default=True,
    help="Directions of the bound table (1 .. n_embd - 1): more reads a bigger table every step but fewer exact rows.",
)
@click.option(
    "--candidates",
    type=click.IntRange(min=1),  # the upper bound is checked with the folder
    default=256,
    show_default=True,
    help="Exact head rows per step inside the body graph (1 .. 4096): more certifies more steps, each a bit slower.",
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the new manifest as JSON.")
@friendly_errors
def sparse_head(model_dir, out, rank, candidates, force, as_json) -> None:
    """Write a variant of MODEL_DIR whose LM head reads only the vocabulary rows that can win (exact tokens)."""
    from gpt2edge.extras import require_extra

    require_extra("quantize", "sparse-head")
    from gpt2edge.sparse.handler import sparse_head as run

    manifest = run(model_dir, out, rank=rank, candidates_k=candidates, force=force)
    if as_json:
        print_json(manifest)
        return
    s = manifest["sparse_head"]
    f = s["fused"]
    click.echo(
        f"wrote {out}: sparse head ({s['kind']}, rank {s['rank']}): each step bounds {f['n_groups']} groups of "
        f"{f['group_size']} tokens, then the tokens of the best {f['groups']}, then reads at most {f['candidates']} "
        f"rows of the {s['head_table_bytes'] / 1e6:.1f} MB head table"
    )
