"""Every file an ONNX graph will open is a listed, checksummed file of its folder: the graph's external-data
locations (read by gpt2edge.onnx_io.external_data without the onnx package) compared with the manifest's graph
files, before ONNX Runtime opens anything."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from gpt2edge.errors import ModelFolderError
from gpt2edge.manifest.fields import shown_path
from gpt2edge.manifest.records import Manifest, check_relpath
from gpt2edge.onnx_io.external_data import external_locations


def graph_protos(info: Manifest) -> tuple[str, ...]:
    """The ONNX files a session is created from: the graph, and a static export's decode graph."""
    if info.graph.format != "onnx":
        return ()
    s = info.graph.static
    return tuple(dict.fromkeys([info.graph.file, *([s.decode_file] if s is not None else [])]))


def _inside(folder: Path, rel: str) -> Path:
    """folder/rel with symlinks resolved, refused outside the folder (as gpt2edge.manifest.resolve_inside)."""
    root = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(root, check_relpath(rel, str(folder))))
    if target == root or not target.startswith(root + os.sep):
        raise ModelFolderError(f"{folder}: {shown_path(rel)} points outside the folder (a symlink?); re-export.")
    return Path(target)


def check_external_data(folder: Path, info: Manifest) -> None:
    """Refuse a graph whose external data is not one of the manifest's graph files (each listed with its size
    and sha256, so verified unless the user skips verification): read before ONNX Runtime opens anything."""
    allowed = set(info.graph.files) & set(info.files)  # both resolve inside the folder (checked on load)
    for rel in graph_protos(info):
        try:
            locations = external_locations(_inside(folder, rel))
        except ModelFolderError:
            # not protobuf: ONNX Runtime refuses the whole file and opens nothing else; the checksum or the
            # session says so with its own words
            continue
        for loc in sorted(locations):
            # ONNX Runtime resolves a location against the graph's own folder; an absolute one or one with ".."
            # never equals a listed name
            target = posixpath.normpath(posixpath.join(posixpath.dirname(rel), loc)) if loc else ""
            if target not in allowed or loc.startswith("/") or ".." in loc.split("/"):
                raise ModelFolderError(
                    f"{folder}: the graph {shown_path(rel)} loads its weights from {shown_path(loc)}, which is not "
                    "one of the graph files the manifest lists and checksums; re-export the model."
                )
