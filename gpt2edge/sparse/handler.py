"""sparse_head: an export folder -> a new, atomically written folder whose LM head runs on a certified part of
the vocabulary table per step (gpt2edge.runtime.sparse_head).

The folder holds the body graph (the parent's graph, returning the hidden state instead of log-probs), the head
graph (the parent's head alone: the full-head path, bit for bit the parent's), and one .npz: the head's table as
its kernel reads it and the bound table (bounds.py). The manifest's `sparse_head` record names them; every file
is checksummed like the rest, so a tampered bound table is refused when the folder is opened.
"""

from __future__ import annotations

import io
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import gpt2edge
from gpt2edge.errors import SparseHeadError
from gpt2edge.folder import atomic_output_dir
from gpt2edge.folder.checks import check_output_dir, check_sources
from gpt2edge.manifest import load_manifest, resolve_inside, verify_files, write_manifest
from gpt2edge.manifest.records import Manifest
from gpt2edge.runtime.sparse_head.record import BOUND_FILE, HEAD_FILE, MAX_RANK, TABLE_FILE

DEFAULT_RANK = 16
DEFAULT_CANDIDATES = 256  # exact rows per step in the body graph (gpt2edge.sparse.fused)
MAX_CANDIDATES = 4096


def check_request(src: Path, out: Path, rank: int, candidates_k: int = DEFAULT_CANDIDATES) -> Manifest:
    """Every refusal that needs no work: one line, before the graph is read."""
    info = load_manifest(src)
    check_sources(out, [src])
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(MAX_RANK, info.dims.n_embd - 1):
        raise SparseHeadError(
            f"--rank must be an integer from 1 to {min(MAX_RANK, info.dims.n_embd - 1)} (below n_embd "
            f"{info.dims.n_embd}), got {rank!r}."
        )
    if isinstance(candidates_k, bool) or not isinstance(candidates_k, int) or not 1 <= candidates_k <= MAX_CANDIDATES:
        raise SparseHeadError(f"--candidates must be an integer from 1 to {MAX_CANDIDATES}, got {candidates_k!r}.")
    if info.raw.get("sparse_head") is not None:
        raise SparseHeadError(f"{src} already has a sparse head; give its parent instead.")
    if info.vocab is not None:
        raise SparseHeadError(
            f"{src} is vocabulary-trimmed ({info.vocab.kept} of {info.vocab.full} tokens); the sparse head keeps every "
            "token: build it on the untrimmed folder."
        )
    if info.graph.static is not None:
        raise SparseHeadError(f"{src} is a static-shape export (--static); build the sparse head on a dynamic export.")
    if info.graph.format != "onnx":
        raise SparseHeadError(f"{src} is a {info.graph.format} folder; build the sparse head on the .onnx folder.")
    if info.graph.head != "last":
        raise SparseHeadError(
            f"{src} is a --head {info.graph.head} export; the sparse head serves generation: give a --head last "
            "export (scoring and speculative verification need every token's log-prob at several positions)."
        )
    if info.graph.precision not in ("fp32", "int8", "int4"):
        raise SparseHeadError(f"{src} is {info.graph.precision}; the sparse head runs fp32, int8 and int4 folders.")
    return info


def sparse_head(
    src: Path, out: Path, *, rank: int = DEFAULT_RANK, candidates_k: int = DEFAULT_CANDIDATES, force: bool = False,
    log=sys.stderr,
) -> dict[str, Any]:
    """Write the sparse-head variant of export folder `src` to `out`; returns the new manifest."""
    import onnx

    from gpt2edge.quantize.graph import save_model, write_variant
    from gpt2edge.sparse.bounds import bound_table
    from gpt2edge.sparse.fused import GROUP_RANK, add_fused, candidates, group_rows, groups_for, slack_scale
    from gpt2edge.sparse.graph import bound_model, split_head
    from gpt2edge.sparse.guard import guard_head, guard_step, step_arrays

    src, out = Path(src), Path(out)
    info = check_request(src, out, rank, candidates_k)
    check_output_dir(out, force, sources=[src])
    verify_files(src, info)
    V, C = info.dims.vocab_size, info.dims.n_embd
    bar_opts = dict(desc="sparse-head", unit="step", file=log, leave=False, disable=None)  # a TTY only
    with tqdm(total=4, **bar_opts) as bar:
        body, head, table = split_head(onnx.load(str(resolve_inside(src, info.graph.file))), V, C)
        bar.update()
        bounds = bound_table(table.dequantized(), rank)
        bar.update()
        # the certified step inside the body graph (fused.py): one session run per certified step
        coarse = bounds if rank <= GROUP_RANK else bound_table(table.dequantized(), GROUP_RANK)
        groups = group_rows(coarse, bounds)
        k, m = candidates(candidates_k, groups_for(candidates_k), groups)
        first = len(body.graph.node)
        add_fused(body, table, bounds, groups, slack_scale(bounds), k, m)
        guard_step(body, first, k)  # skipped where the runtime runs the step natively (guard.py)
        guard_head(body, head)  # the full head in the body's run, for the steps that need it
        step = step_arrays(bounds, groups, slack_scale(bounds))
        fused = {"candidates": k, "groups": m, "group_size": groups.size, "n_groups": len(groups.members)}
        bar.update()
        with atomic_output_dir(out, force=force, sources=[src]) as tmp:
            files = write_variant(body, info, src, tmp)
            del body
            save_model(head, tmp / HEAD_FILE)
            opset = next(o for o in head.opset_import if o.domain in ("", "ai.onnx"))
            save_model(bound_model(bounds.pop("a_t"), bounds["eps"], opset), tmp / BOUND_FILE)
            arrays = {**bounds, **step, "bits": np.array(table.bits), "block_size": np.array(table.block_size)}
            if table.codes is None:
                arrays["weight"] = table.weight
            else:
                arrays.update(codes=table.codes, zero_points=table.zero_points, scales=table.scales)
            buf = io.BytesIO()
            np.savez(buf, **arrays, allow_pickle=False)
            (tmp / TABLE_FILE).write_bytes(buf.getvalue())
            bar.update()
            manifest = write_manifest(tmp, _manifest(info, src, files, tmp, table.kind, rank, arrays, fused))
    return manifest


def _manifest(
    info: Manifest, src: Path, files: list[str], tmp: Path, kind: str, rank: int, arrays: dict[str, np.ndarray],
    fused: dict[str, int],
) -> dict[str, Any]:
    """The parent's manifest with the body graph's files and outputs, and the sparse_head record."""
    from gpt2edge.onnx_io.stats import decode_weight_bytes

    parent = dict(info.raw)
    graph = dict(parent["graph"])
    graph.update(files=files, decode_weight_bytes=decode_weight_bytes(tmp / files[0]))
    C = info.dims.n_embd
    graph["outputs"] = [
        {"name": "hidden", "dtype": "float32", "shape": ["batch", C]} if t.get("name") == "logprobs" else t
        for t in graph.get("outputs", [])
    ]
    dropped = ("files", "validation", "quality", "format", "format_version")
    manifest = {k: v for k, v in parent.items() if k not in dropped}
    V = info.dims.vocab_size
    manifest.update(
        gpt2edge_version=gpt2edge.__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        graph=graph,
        sparse_head={
            "head_file": HEAD_FILE,
            "table_file": TABLE_FILE,
            "kind": kind,  # how the head's kernel computes a logit (record.py)
            "rank": rank,
            "bound_file": BOUND_FILE,
            "fused": fused,  # the body graph's certified step (gpt2edge.sparse.fused)
            "bound_table_bytes": int((rank + 1) * V * 4),
            "head_table_bytes": int(V * C * (4 if "weight" in arrays else int(arrays["bits"]) / 8)),
            "parent": {
                "path": str(src.resolve()),
                "precision": info.graph.precision,
                "sha256": {f: info.files[f].sha256 for f in info.graph.files},
            },
        },
    )
    return manifest
