"""The manifest of an export folder: what the graph is, where it came from, and a checksum of every file.

Everything that runs a folder (runtime, quantize, parity, bench) reads it from here; nothing infers a recipe
from file names. No torch or onnx import: the runtime uses this on the device.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from gpt2edge.errors import ModelFolderError

MANIFEST_NAME = "manifest.json"
FORMAT = "gpt2edge-export"
FORMAT_VERSION = 1

# graph kinds a manifest may describe (graph.head, graph.kv_cache), and what computes attention in each
# (graph.attention): the exporter writes these, the CLI offers them, the runtime checks them
HEAD_MODES = ("last", "all")
KV_CACHE_MODES = ("concat", "shared")
ATTENTION_OPS = {"concat": "onnx", "shared": "com.microsoft.GroupQueryAttention"}
# graph.format: "onnx" (export, quantize), "ort" (ONNX Runtime's flatbuffer, for minimal builds) and "genai"
# (an ONNX graph in onnxruntime-genai's IO contract, run by genai, not by gpt2edge's runtime); see gpt2edge.convert
GRAPH_FORMATS = ("onnx", "ort", "genai")


def file_digest(path: Path) -> dict[str, Any]:
    """sha256 and size of one file, read in 1 MiB chunks so multi-GB data files never sit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"sha256": h.hexdigest(), "size": path.stat().st_size}


def digest_folder(folder: Path) -> dict[str, dict[str, Any]]:
    """Digests of every file in the folder except the manifest itself, keyed by relative path."""
    folder = Path(folder)
    return {
        p.relative_to(folder).as_posix(): file_digest(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Fill in the file digests and write manifest.json; returns the manifest as written."""
    manifest = dict(manifest)
    manifest["format"] = FORMAT
    manifest["format_version"] = FORMAT_VERSION
    manifest["files"] = digest_folder(folder)
    (Path(folder) / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    """Load and sanity-check manifest.json, raising a ModelFolderError that says what is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"Model folder {folder} does not exist (make one with `gpt2edge export`).")
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ModelFolderError(
            f"{folder} is not a gpt2edge export: it has no {MANIFEST_NAME} (make one with `gpt2edge export`)."
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path} is not valid JSON ({e}); re-export the model.") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ModelFolderError(f"{path} is not a gpt2edge manifest; re-export the model with `gpt2edge export`.")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ModelFolderError(
            f"{folder} was written by a newer gpt2edge (manifest format {manifest['format_version']}); "
            "upgrade gpt2edge."
        )
    return manifest


def graph_files(manifest: dict[str, Any]) -> list[str]:
    """The files of the graph: the .onnx and, for graphs over 2 GB, its external data."""
    graph = manifest["graph"]
    return graph.get("files", [graph["file"]])


def verify_files(folder: Path, manifest: dict[str, Any]) -> None:
    """Check every file listed in the manifest exists with the recorded size and sha256."""
    folder = Path(folder)
    for rel, expected in manifest.get("files", {}).items():
        p = folder / rel
        if not p.is_file():
            raise ModelFolderError(f"{folder} is incomplete: {rel} is listed in the manifest but missing.")
        actual = file_digest(p)
        if actual != expected:
            raise ModelFolderError(
                f"{p} does not match its manifest checksum (modified or corrupted); re-export the model, "
                "or pass --no-verify to skip the check."
            )
