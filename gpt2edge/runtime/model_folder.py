"""An export folder as the runtime sees it: everything comes from manifest.json, nothing from file names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.errors import ModelFolderError
from gpt2edge.manifest import ATTENTION_OPS, GRAPH_FORMATS, graph_files, read_manifest, verify_files

_DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclass
class ModelFolder:
    path: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> ModelFolder:
        """Read the manifest and (by default) check every file's sha256 before anything is loaded."""
        path = Path(path)
        manifest = read_manifest(path)
        graph = manifest.get("graph")
        if not isinstance(graph, dict) or "file" not in graph or "dims" not in manifest:
            raise ModelFolderError(f"{path}/manifest.json has no graph description; re-export the model.")
        _check_graph_format(path, graph.get("format", "onnx"))
        if verify:
            verify_files(path, manifest)
        elif not (path / graph["file"]).is_file():
            raise ModelFolderError(f"{path} is incomplete: {graph['file']} is missing.")
        if graph.get("kv_dtype", "float32") not in _DTYPES:
            raise ModelFolderError(f"{path}: unsupported KV cache dtype {graph.get('kv_dtype')!r}.")
        kv_cache = graph.get("kv_cache", "concat")
        if kv_cache == "shared" and graph.get("attention") != ATTENTION_OPS[kv_cache]:
            raise ModelFolderError(
                f"{path} is a shared-cache export from an older gpt2edge (its graph returns only the new "
                "cache entries); export it again with --kv-cache shared."
            )
        return cls(path=path, manifest=manifest)

    @property
    def graph_path(self) -> Path:
        return self.path / self.manifest["graph"]["file"]

    @property
    def graph_format(self) -> str:
        """ "onnx" or "ort" (ONNX Runtime's own format; gpt2edge.manifest.GRAPH_FORMATS)."""
        return self.manifest["graph"].get("format", "onnx")

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest.get("tokenizer", "tokenizer.json")

    @property
    def dims(self) -> dict[str, Any]:
        return self.manifest["dims"]

    @property
    def head(self) -> str:
        return self.manifest["graph"].get("head", "last")

    @property
    def kv_cache(self) -> str:
        """ "concat" or "shared" (see gpt2edge.manifest.KV_CACHE_MODES)."""
        return self.manifest["graph"].get("kv_cache", "concat")

    @property
    def kv_dtype(self) -> type:
        return _DTYPES[self.manifest["graph"].get("kv_dtype", "float32")]

    @property
    def precision(self) -> str:
        return self.manifest["graph"].get("precision", "fp32")

    def generation_defaults(self) -> dict[str, Any]:
        """generation_config.json of the source checkpoint, or {} when it has none."""
        p = self.path / "generation_config.json"
        return json.loads(p.read_text()) if p.is_file() else {}

    def model_bytes(self) -> int:
        """Bytes of the graph files (the .onnx and its external data), as listed in the manifest."""
        return sum(self.manifest["files"][f]["size"] for f in graph_files(self.manifest))


def _check_graph_format(path: Path, fmt: str) -> None:
    """The runtime runs .onnx and .ort graphs; a genai folder is for onnxruntime-genai (its logits differ)."""
    if fmt == "genai":
        raise ModelFolderError(
            f"{path} is an onnxruntime-genai folder (`gpt2edge convert --format genai`); run it with "
            "onnxruntime_genai.Model, or give gpt2edge the folder it was converted from."
        )
    if fmt not in GRAPH_FORMATS:
        raise ModelFolderError(f"{path} holds a graph in format {fmt!r}, unknown to this gpt2edge; upgrade gpt2edge.")
