"""`gpt2edge sparse-head`: write the certified sparse-head variant of an export folder (or, with --mode cluster,
an approximate one with a quality report)."""

from __future__ import annotations

from pathlib import Path

import click

from gpt2edge.cli.common import friendly_errors, main, print_json
from gpt2edge.errors import SparseHeadError
from gpt2edge.sparse.modes import SPARSE_MODES


@main.command("sparse-head")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="New export folder.")
@click.option(
    "--mode",
    type=click.Choice(SPARSE_MODES),
    default="exact",
    show_default=True,
    help="exact: the full head's tokens, certified; cluster: APPROXIMATE (adaptive-softmax-style clusters), with "
    "a quality report.",
)
@click.option(
    "--rank",
    type=click.IntRange(min=1),  # the model's bound (below n_embd) is checked with the folder
    default=None,
    help="exact: directions of the bound table (1 .. n_embd - 1) [default: 16]: more reads a bigger table every "
    "step but fewer exact rows.",
)
@click.option(
    "--candidates",
    type=click.IntRange(min=1),  # the upper bound is checked with the folder
    default=None,
    help="exact: head rows computed per step by the certified step (1 .. 4096) [default: 256]: more certifies "
    "more steps, each a bit slower.",
)
@click.option(
    "--clusters",
    type=click.IntRange(2, 4096),  # at most V / 2 as well: checked with the folder
    default=None,
    help="cluster: clusters of the vocabulary (2 .. 4096, at most V / 2) [default: 1024, or V / 2 if fewer].",
)
@click.option(
    "--probe",
    type=click.IntRange(min=1),  # at most --clusters: checked with the folder
    default=None,
    help="cluster: clusters read exactly per step (1 .. --clusters) [default: 16, or --clusters if fewer].",
)
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="cluster: held-out text the quality report scores (default: the folder's recorded text, or the built-in one).",
)
@click.option(
    "--report-tokens",
    type=click.IntRange(2, 4096),
    default=None,
    help="cluster: tokens of the text scored (2 .. 4096) [default: 1024].",
)
@click.option("--no-report", is_flag=True, help="cluster: skip the quality report.")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the new manifest as JSON.")
@friendly_errors
def sparse_head(
    model_dir, out, mode, rank, candidates, clusters, probe, text_file, report_tokens, no_report, force, as_json
) -> None:
    """Write a variant of MODEL_DIR whose LM head reads only part of the vocabulary table per step: exact tokens
    (default), or an approximate head with --mode cluster. The exact head of a --head tail export is a
    speculative target: each verified position is certified on its own."""
    from gpt2edge.extras import require_extra

    require_extra("quantize", "sparse-head")
    if mode == "exact":
        cluster_only = {"--clusters": clusters, "--probe": probe, "--text": text_file,
                        "--report-tokens": report_tokens, "--no-report": no_report or None}  # fmt: skip
        given = [name for name, value in cluster_only.items() if value is not None]
        if given:
            raise SparseHeadError(f"{', '.join(given)} only apply to --mode cluster (the exact mode has no report).")
        from gpt2edge.sparse.handler import DEFAULT_CANDIDATES
        from gpt2edge.sparse.handler import sparse_head as run

        manifest = run(model_dir, out, rank=16 if rank is None else rank,
                       candidates_k=DEFAULT_CANDIDATES if candidates is None else candidates, force=force)  # fmt: skip
    else:
        if rank is not None or candidates is not None:
            raise SparseHeadError(
                "--rank and --candidates apply to --mode exact; --mode cluster takes --clusters and --probe."
            )
        from gpt2edge.report_text import choose_report_text
        from gpt2edge.sparse.approx_handler import DEFAULT_REPORT_TOKENS, cluster_sparse_head

        chosen = choose_report_text(text_file, [model_dir])
        log = click.get_text_stream("stderr")
        manifest = cluster_sparse_head(
            model_dir, out, force=force, report=not no_report, text=chosen.text, text_source=chosen.source,
            clusters=clusters, probe=probe,
            report_tokens=DEFAULT_REPORT_TOKENS if report_tokens is None else report_tokens, log=log,
        )  # fmt: skip
        if chosen.note and not no_report:
            click.echo(chosen.note, err=True)
    if as_json:
        print_json(manifest)
        return
    s = manifest["sparse_head"]
    if mode == "cluster":
        click.echo(
            f"wrote {out}: APPROXIMATE sparse head ({s['clusters']} clusters, {s['probe']} probed): "
            f"{s['rows_per_step']} of {manifest['dims']['vocab_size']} rows scored exactly per step, the rest "
            "estimated; not the model's own distribution (see the quality report)"
        )
        return
    f = s["fused"]
    click.echo(
        f"wrote {out}: sparse head ({s['kind']}, rank {s['rank']}): each step bounds {f['n_groups']} groups of "
        f"{f['group_size']} tokens, then the tokens of the best {f['groups']}, then reads at most {f['candidates']} "
        f"rows of the {s['head_table_bytes'] / 1e6:.1f} MB head table"
    )
