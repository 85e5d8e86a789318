"""trim_vocab: an export folder -> a new, atomically written folder whose head scores only the kept tokens.

The handler checks the request before any work, picks the kept ids (keep.py), rewrites the head (graph.py),
copies the tokenizer and configs, writes the kept ids and the manifest, and measures the quality report
against the parent (gpt2edge.quality, which compares a trimmed folder on its kept ids: quality/trimmed.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.api_args import path_arg, text_arg
from gpt2edge.errors import TrimError
from gpt2edge.folder.checks import check_inputs
from gpt2edge.folder.derive import Derivation
from gpt2edge.manifest import resolve_inside, write_manifest
from gpt2edge.manifest.records import GENERATION_CONFIG, Manifest
from gpt2edge.onnx_io.stats import decode_weight_bytes
from gpt2edge.progress import Progress
from gpt2edge.report_text import BUILT_IN, record_text
from gpt2edge.trim.keep import KeepSet, keep_from_corpus, keep_from_ids

KEPT_IDS_FILE = "kept_ids.npy"


def eos_ids(src: Path, info: Manifest) -> tuple[int, ...]:
    """The end-of-text id(s) generation stops on: generation_config.json's, else config.json's."""
    for name in (GENERATION_CONFIG, "config.json"):
        if name not in info.files:
            continue
        try:
            eos = json.loads(resolve_inside(src, name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError, RecursionError):
            continue
        eos = eos if isinstance(eos, list) else [eos]
        if eos and all(type(e) is int and 0 <= e < info.dims.vocab_size for e in eos):
            return tuple(eos)
    raise TrimError(f"{src} names no valid eos_token_id (generation_config.json or config.json); re-export it.")


def check_request(
    src: Path, out: Path, keep_from: Sequence[Path], keep_ids: Path | None, top: int | None, force: bool = False
) -> Derivation:
    """Every refusal that needs no work, so a bad request fails in a second with one line."""
    if bool(keep_from) == (keep_ids is not None):
        raise TrimError("Give either --keep-from CORPUS or --keep-ids FILE (exactly one of them).")
    if top is not None and keep_ids is not None:
        raise TrimError("--top picks the corpus's most frequent tokens; it applies to --keep-from only.")
    d = Derivation(src, out, "trim-vocab", force=force)
    info, src, out = d.parent, d.src, d.out
    # a corpus or id list inside OUT would be deleted by --force too
    check_inputs(out, [*((f"--keep-from {p}", p) for p in keep_from), (f"--keep-ids {keep_ids}", keep_ids)])
    if info.vocab is not None:
        raise TrimError(
            f"{src} is already vocabulary-trimmed ({info.vocab.kept} of {info.vocab.full} tokens); trim its "
            f"untrimmed parent ({info.raw.get('trim', {}).get('parent', {}).get('path', '?')}) instead."
        )
    if info.graph.static is not None:
        raise TrimError(f"{src} is a static-shape export (--static); trim the dynamic export instead.")
    if info.graph.format != "onnx":  # an .ort graph is no ONNX protobuf: onnx cannot read it to rewrite the head
        origin = info.raw.get("conversion", {}).get("parent", {}).get("path", "?")
        raise TrimError(
            f"{src} is a converted ({info.graph.format}) folder; trim the .onnx export it came from ({origin}), "
            "then convert the trimmed folder."
        )
    if info.graph.head != "last":
        raise TrimError(
            f"{src} is a --head all (scoring) export, which needs every token's probability; trim a generation "
            "export (--head last)."
        )
    return d


def trim_vocab(
    src: Path,
    out: Path,
    *,
    keep_from: Sequence[Path] = (),
    top: int | None = None,
    keep_ids: Path | None = None,
    force: bool = False,
    text: str | None = None,
    max_tokens: int = 256,
    report: bool = True,
    log=sys.stderr,
    text_source: str | None = None,
) -> dict[str, Any]:
    """Write the vocabulary-trimmed variant of export folder `src` to `out`; returns the new manifest. A `text` is
    recorded in the new folder for later reports (gpt2edge.report_text); `text_source` names it in the report."""
    import onnx

    from gpt2edge.quality import compare_folders, print_report
    from gpt2edge.quantize.graph import write_variant
    from gpt2edge.trim.graph import trim_head

    src, out = path_arg(src, "src"), path_arg(out, "out")  # a TypeError names a wrong type, before any other check
    text = None if text is None else text_arg(text, "text")
    d = check_request(src, out, keep_from, keep_ids, top, force)
    info, src = d.parent, d.src
    d.ready()  # OUT, then every checksum
    V = info.dims.vocab_size
    tokenizer = resolve_inside(src, info.tokenizer)
    eos = eos_ids(src, info)
    if keep_ids is not None:
        keep = keep_from_ids(tokenizer, V, eos, Path(keep_ids))
    else:
        keep = keep_from_corpus(tokenizer, V, eos, [Path(p) for p in keep_from], top)

    with Progress(3 if report else 2, "trim-vocab", file=sys.stderr) as bar:  # a bar on a TTY, else periodic lines
        trimmed = trim_head(onnx.load(str(resolve_inside(src, info.graph.file))), keep.ids, V)
        bar.update()
        with d.output() as tmp:
            files = write_variant(trimmed, d, tmp)
            del trimmed
            np.save(tmp / KEPT_IDS_FILE, keep.ids, allow_pickle=False)
            if text is not None:
                record_text(tmp, text)
            bar.update()
            manifest = d.write_manifest(tmp, **_trimmed_fields(info, keep, files, tmp))
            if report:
                # measured on the finished folder, exactly as the runtime will load it
                bar.set_postfix_str("quality report")
                manifest["trim"]["quality"] = compare_folders(src, tmp, text=text, max_tokens=max_tokens)
                manifest["trim"]["quality"]["text_scored"] = text_source or ("--text" if text is not None else BUILT_IN)
                bar.update()
                bar.clear()
                print_report(manifest["trim"]["quality"], title="trimmed vs full", file=log)
                manifest = write_manifest(tmp, manifest)
    return manifest


def _trimmed_fields(info: Manifest, keep: KeepSet, files: list[str], tmp: Path) -> dict[str, Any]:
    """The graph's files and output width, the trim record and the vocab record."""
    K, V = int(keep.ids.size), info.dims.vocab_size
    graph = dict(info.raw["graph"])
    graph.update(files=files, decode_weight_bytes=decode_weight_bytes(tmp / files[0]))
    graph["outputs"] = [
        {**t, "shape": [*t["shape"][:-1], K]} if t.get("name") == "logprobs" else t for t in graph.get("outputs", [])
    ]
    after = sum((tmp / f).stat().st_size for f in files)
    record = {
        **keep.to_json(),
        "input_embedding": "whole",  # prompts embed every id; only the head was trimmed
        "decode_weight_bytes_before": info.graph.decode_weight_bytes,
        "decode_weight_bytes_after": graph["decode_weight_bytes"],
        "size_before": info.model_bytes(),
        "size_after": after,
    }
    return {"graph": graph, "record": record, "vocab": {"kept_ids_file": KEPT_IDS_FILE, "kept": K, "full": V}}
