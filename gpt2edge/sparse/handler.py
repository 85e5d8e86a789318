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
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gpt2edge.errors import SparseHeadError
from gpt2edge.folder.derive import Derivation
from gpt2edge.manifest import resolve_inside
from gpt2edge.manifest.records import Manifest
from gpt2edge.runtime.sparse_head.record import BOUND_FILE, HEAD_FILE, MAX_RANK, TABLE_FILE

DEFAULT_RANK = 16
DEFAULT_CANDIDATES = 256  # exact rows per step in the body graph (gpt2edge.sparse.fused)
MAX_CANDIDATES = 4096


def check_request(
    src: Path, out: Path, rank: int, candidates_k: int = DEFAULT_CANDIDATES, force: bool = False
) -> Derivation:
    """Every refusal that needs no work: one line, before the graph is read."""
    d = Derivation(src, out, "sparse-head", force=force)
    info, src = d.parent, d.src
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
    if info.graph.head not in ("last", "tail"):
        raise SparseHeadError(
            f"{src} is a --head {info.graph.head} export; the sparse head serves generation: give a --head last "
            "export, or a --head tail one for speculative decoding (scoring needs every position's log-probs)."
        )
    if info.graph.precision not in ("fp32", "int8", "int4"):
        raise SparseHeadError(f"{src} is {info.graph.precision}; the sparse head runs fp32, int8 and int4 folders.")
    return d


def sparse_head(
    src: Path,
    out: Path,
    *,
    rank: int = DEFAULT_RANK,
    candidates_k: int = DEFAULT_CANDIDATES,
    force: bool = False,
    log=sys.stderr,
) -> dict[str, Any]:
    """Write the sparse-head variant of export folder `src` to `out`; returns the new manifest."""
    import onnx

    from gpt2edge.quantize.graph import save_model, write_variant
    from gpt2edge.sparse.bounds import bound_table
    from gpt2edge.sparse.fused import GROUP_RANK, add_fused, candidates, group_rows, groups_for, slack_scale
    from gpt2edge.sparse.graph import bound_model, split_head
    from gpt2edge.sparse.guard import guard_head, guard_step, step_arrays

    d = check_request(src, out, rank, candidates_k, force)
    info, src = d.parent, d.src
    d.ready()  # OUT, then every checksum
    V, C = info.dims.vocab_size, info.dims.n_embd
    # a --head tail graph's hidden is (batch, keep, C): its certified step runs natively, per kept position
    # (the graph's own step and its in-graph head are written for one (B, C) row a step)
    tail = info.graph.head == "tail"
    bar_opts = dict(desc="sparse-head", unit="step", file=log, leave=False, disable=None)  # a TTY only
    with tqdm(total=4, **bar_opts) as bar:
        body, head, table = split_head(onnx.load(str(resolve_inside(src, info.graph.file))), V, C, tail=tail)
        bar.update()
        bounds = bound_table(table.dequantized(), rank)
        bar.update()
        # the certified step inside the body graph (fused.py): one session run per certified step
        coarse = bounds if rank <= GROUP_RANK else bound_table(table.dequantized(), GROUP_RANK)
        groups = group_rows(coarse, bounds)
        k, m = candidates(candidates_k, groups_for(candidates_k), groups)
        if not tail:
            first = len(body.graph.node)
            add_fused(body, table, bounds, groups, slack_scale(bounds), k, m)
            guard_step(body, first, k)  # skipped where the runtime runs the step natively (guard.py)
            guard_head(body, head)  # the full head in the body's run, for the steps that need it
        step = step_arrays(bounds, groups, slack_scale(bounds))
        fused = {"candidates": k, "groups": m, "group_size": groups.size, "n_groups": len(groups.members)}
        bar.update()
        with d.output() as tmp:
            files = write_variant(body, d, tmp)
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
            manifest = d.write_manifest(tmp, **_sparse_fields(info, files, tmp, table.kind, rank, arrays, fused))
    return manifest


def body_graph(info: Manifest, files: list[str], tmp: Path) -> dict[str, Any]:
    """The body graph's fields: its files, and the hidden state where the parent returned log-probs."""
    from gpt2edge.onnx_io.stats import decode_weight_bytes

    graph = dict(info.raw["graph"])
    graph.update(files=files, decode_weight_bytes=decode_weight_bytes(tmp / files[0]))
    rows = ["batch", "keep"] if info.graph.head == "tail" else ["batch"]  # a tail graph's kept positions
    graph["outputs"] = [
        {"name": "hidden", "dtype": "float32", "shape": [*rows, info.dims.n_embd]} if t.get("name") == "logprobs"
        else t
        for t in graph.get("outputs", [])
    ]  # fmt: skip
    return graph


def _sparse_fields(
    info: Manifest,
    files: list[str],
    tmp: Path,
    kind: str,
    rank: int,
    arrays: dict[str, np.ndarray],
    fused: dict[str, int],
) -> dict[str, Any]:
    """The body graph's fields and the sparse_head record."""
    C, V = info.dims.n_embd, info.dims.vocab_size
    record = {
        "head_file": HEAD_FILE,
        "table_file": TABLE_FILE,
        "kind": kind,  # how the head's kernel computes a logit (record.py)
        "rank": rank,
        "bound_file": BOUND_FILE,
        "fused": fused,  # the certified step's sizes: in the body graph (gpt2edge.sparse.fused), native for a tail
        "bound_table_bytes": int((rank + 1) * V * 4),
        "head_table_bytes": int(V * C * (4 if "weight" in arrays else int(arrays["bits"]) / 8)),
    }
    return {"graph": body_graph(info, files, tmp), "record": record}
