"""sparse-head --mode cluster: an export folder -> a new, atomically written folder whose LM head is APPROXIMATE
(adaptive-softmax-style: the best of K cluster centroids are probed, their tokens scored exactly, every other
token estimated by its cluster's mean logit). Never the default; the manifest says `approximate`, the runtime
labels every result and refuses log-probs, beam search and scoring (gpt2edge.runtime.sparse_head.approx).

The folder holds the body graph (the parent's, returning the hidden state, as the exact mode's) and approx.onnx
(gpt2edge.sparse.approx_graph: centroids, the cluster-ordered table and the token map as its initializers), both
listed with their sha256 in the manifest: a tampered table fails its checksum when the folder is opened. The
quality report (gpt2edge.sparse.approx_report) is measured on the folder before it is moved into place.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gpt2edge.errors import GenerationError, SparseHeadError
from gpt2edge.manifest import resolve_inside, write_manifest
from gpt2edge.manifest.records import Manifest
from gpt2edge.runtime.sparse_head.approx import APPROX_FILE, MAX_CLUSTERS

DEFAULT_CLUSTERS = 1024
DEFAULT_PROBE = 16
DEFAULT_REPORT_TOKENS = 1024
MAX_REPORT_TOKENS = 4096  # two (T, V) float32 log-prob matrices are held: 1.6 GB at 50,257 tokens


def _int_in(name: str, value: Any, lo: int, hi: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SparseHeadError(f"{name} must be an integer from {lo} to {hi} ({why}), got {value!r}.")


def check_cluster_options(info: Manifest, clusters: int, probe: int, report_tokens: int) -> None:
    """Range checks: one line each, before any work."""
    V = info.dims.vocab_size
    hi = min(MAX_CLUSTERS, V // 2)
    _int_in("--clusters", clusters, 2, hi, f"at most {MAX_CLUSTERS} and half the {V}-token vocabulary")
    _int_in("--probe", probe, 1, clusters, "clusters scored exactly per step, at most --clusters")
    _int_in("--report-tokens", report_tokens, 2, MAX_REPORT_TOKENS, "tokens of the text the report scores")


def report_tokens_of(src: Path, text: str | None, n: int) -> list[int]:
    """The report's tokens (the built-in sample without --text), checked now: at least 2."""
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.model.tokenizer import TextTokenizer
    from gpt2edge.sample_text import SAMPLE_TEXT

    folder = ModelFolder.open(src, verify=False)
    ids = TextTokenizer(folder.tokenizer_path, folder.dims.vocab_size).encode(
        text if text is not None else SAMPLE_TEXT
    )[:n]
    if len(ids) < 2:
        raise GenerationError(f"The --text has {len(ids)} token(s); the quality report needs at least 2.")
    return ids


def cluster_sparse_head(
    src: Path,
    out: Path,
    *,
    clusters: int | None = None,
    probe: int | None = None,
    force: bool = False,
    report: bool = True,
    text: str | None = None,
    text_source: str | None = None,
    report_tokens: int = DEFAULT_REPORT_TOKENS,
    log=sys.stderr,
) -> dict[str, Any]:
    """Write the approximate (cluster) sparse-head variant of export folder `src` to `out`; returns its manifest.
    clusters: default 1024 (half the vocabulary if that is fewer); probe: default 16 (at most clusters)."""
    import onnx

    from gpt2edge.quality import print_report
    from gpt2edge.quantize.graph import save_model, write_variant
    from gpt2edge.report_text import BUILT_IN
    from gpt2edge.sparse.approx_cluster import cluster_rows
    from gpt2edge.sparse.approx_graph import cluster_head
    from gpt2edge.sparse.graph import split_head
    from gpt2edge.sparse.handler import check_request

    d = check_request(src, out, 1, force=force)  # the folder kinds the exact mode refuses are refused here too
    info, src = d.parent, d.src
    if info.graph.head != "last":  # speculative verification is exact only on the certified head
        raise SparseHeadError(
            f"{src} is a --head {info.graph.head} export; --mode cluster serves generation from a --head last export "
            "(the certified --mode exact takes --head tail exports too, for speculative decoding)."
        )
    if clusters is None:  # a small vocabulary gets fewer (each cluster at least 2 rows)
        clusters = min(DEFAULT_CLUSTERS, info.dims.vocab_size // 2)
    if probe is None:
        probe = min(DEFAULT_PROBE, clusters) if isinstance(clusters, int) else DEFAULT_PROBE
    check_cluster_options(info, clusters, probe, report_tokens)
    tokens = report_tokens_of(src, text, report_tokens) if report else None
    d.ready()  # OUT, then every checksum
    V, C = info.dims.vocab_size, info.dims.n_embd
    bar_opts = dict(desc="sparse-head cluster", unit="step", file=log, leave=False, disable=None)  # a TTY only
    with tqdm(total=4 if report else 3, **bar_opts) as bar:
        body, head, table = split_head(onnx.load(str(resolve_inside(src, info.graph.file))), V, C)
        bar.update()
        groups = cluster_rows(table.dequantized(), clusters)
        bar.update()
        with d.output() as tmp:
            files = write_variant(body, d, tmp)
            del body
            save_model(cluster_head(table, groups, probe, V, C), tmp / APPROX_FILE)
            manifest = d.write_manifest(tmp, **_cluster_fields(info, files, tmp, table, clusters, probe, groups.size))
            bar.update()
            if report:
                from gpt2edge.sparse.approx_report import cluster_report

                quality = cluster_report(tmp, src, head, tokens)
                quality.update(variant=str(d.out), text_scored=text_source or ("--text" if text else BUILT_IN))
                manifest = write_manifest(tmp, {**manifest, "quality": quality})
                bar.update()
    if report:
        print_report(manifest["quality"], title=f"cluster head ({clusters} clusters, probe {probe}) vs full head",
                     file=log)  # fmt: skip
        q = manifest["quality"]
        print(f"  {'max KL':<26} {q['max_kl']:.3e}", file=log)
        print(f"  {'rows read per step':<26} {q['rows_read_per_step']} of {V} ({q['rows_read_fraction']:.2%}) "
              f"+ {clusters} centroids", file=log)  # fmt: skip
    return manifest


def _cluster_fields(
    info: Manifest, files: list[str], tmp: Path, table, clusters: int, probe: int, size: int
) -> dict[str, Any]:
    """The body graph's fields and the approximate sparse_head record."""
    from gpt2edge.sparse.handler import body_graph

    C, V = info.dims.n_embd, info.dims.vocab_size
    row_bytes = C * 4 if table.codes is None else C + 5 * table.scales.shape[1]  # codes a byte each, zp, scale
    record = {
        "mode": "cluster",
        "approximate": True,  # not the model's distribution: the runtime labels and refuses what it must
        "head_file": APPROX_FILE,
        "kind": table.kind,
        "clusters": clusters,
        "probe": probe,
        "cluster_size": size,
        "tail": "cluster-mean",  # unprobed tokens: their cluster's mean logit (not -inf)
        "rows_per_step": probe * size,
        "bytes_per_step": int(clusters * C * 4 + probe * size * row_bytes),
        "head_table_bytes": int(V * row_bytes),
    }
    return {"graph": body_graph(info, files, tmp), "record": record}
