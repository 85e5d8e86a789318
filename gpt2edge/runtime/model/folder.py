"""An export folder as the runtime sees it: everything comes from manifest.json, nothing from file names."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from gpt2edge.api_args import path_arg
from gpt2edge.cpu_facts import target_note
from gpt2edge.errors import ArgumentTypeError, ModelFolderError
from gpt2edge.manifest import check_present, load_manifest, resolve_inside
from gpt2edge.manifest.external_data import check_external_data
from gpt2edge.manifest.records import ATTENTION_OPS, GENERATION_CONFIG, GraphInfo, Manifest, ModelDims
from gpt2edge.manifest.verified import verify_folder
from gpt2edge.runtime.model.graph_cache import GraphCache

_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


@dataclass(frozen=True)
class ModelFolder:
    path: Path
    info: Manifest  # the typed, validated manifest
    verify: bool | str = "fast"  # how it was opened: "full" also hashes its optimized-graph cache entry

    @classmethod
    def open(cls, path: str | Path, verify: bool | str = True) -> ModelFolder:
        """Read the manifest and check every file it will load: sha256 by default, presence with verify=False.

        verify=True or "fast": skip re-hashing files unchanged (size, mtime, ctime, inode) since a full check
        recorded them (gpt2edge.manifest.verified says what that trusts); "full": hash every file.
        Either way every path resolves inside the folder (symlinks included), so nothing outside is loaded.
        """
        path = path_arg(path, "path")  # a TypeError names a wrong type
        if not isinstance(verify, (bool, str)):
            raise ArgumentTypeError(f"verify must be True, False, 'fast' or 'full', got {type(verify).__name__}")
        mode = "fast" if verify is True else verify
        if mode not in (False, "fast", "full"):  # checked before any work
            raise ModelFolderError(f"verify must be True, False, 'fast' or 'full', got {verify!r}")
        info = load_manifest(path)
        _check_graph_format(path, info.graph.format)
        if verify:
            verify_folder(path, info, mode)  # checksums, and the graph's external data is among the files checked
        check_present(path, info.loaded_files())
        if not verify:
            check_external_data(path, info)  # without checksums, still no file the manifest does not list
        if info.graph.kv_dtype not in _DTYPES:
            raise ModelFolderError(f"{path}: unsupported KV cache dtype {info.graph.kv_dtype!r}.")
        if info.graph.kv_cache == "shared" and info.graph.attention != ATTENTION_OPS["shared"]:
            raise ModelFolderError(
                f"{path} is a shared-cache export from an older gpt2edge (its graph returns only the new "
                "cache entries); export it again with --kv-cache shared."
            )
        note = target_note(info.raw, str(path))  # an ARM folder for features this ARM CPU lacks: runs, slower
        if note is not None:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        return cls(path=path, info=info, verify=mode)

    def graph_cache(self) -> GraphCache:
        """The folder's entry in the optimized-graph cache (gpt2edge.runtime.model.graph_cache), keyed by its graph
        files' checksums as the manifest lists them."""
        sources = {rel: self.info.files[rel].sha256 for rel in self.info.graph.files if rel in self.info.files}
        return GraphCache(self.path, self.graph_path, sources, full=self.verify == "full")

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest as plain JSON (for fields with no typed form: source, quantization, quality)."""
        return dict(self.info.raw)

    @property
    def graph(self) -> GraphInfo:
        return self.info.graph

    @property
    def dims(self) -> ModelDims:
        return self.info.dims

    @property
    def graph_format(self) -> str:
        """ "onnx" or "ort" (ONNX Runtime's own format; gpt2edge.manifest.records.GRAPH_FORMATS)."""
        return self.info.graph.format

    # resolved once (symlinks followed, checked inside the folder): a decode step names the graph in its error
    # context, and resolving the path there cost ~0.15 ms a step, 4 % of an int4 GPT-2 small step
    @cached_property
    def graph_path(self) -> Path:
        return resolve_inside(self.path, self.info.graph.file)

    @cached_property
    def tokenizer_path(self) -> Path:
        return resolve_inside(self.path, self.info.tokenizer)

    @property
    def head(self) -> str:
        return self.info.graph.head

    @property
    def kv_cache(self) -> str:
        """ "concat" or "shared" (see gpt2edge.manifest.records.KV_CACHE_MODES)."""
        return self.info.graph.kv_cache

    @property
    def n_positions(self) -> int:
        """Positions one generation can hold: the model's, or a static-shape export's cache capacity."""
        s = self.info.graph.static
        return s.capacity if s is not None else self.info.dims.n_positions

    @property
    def kv_dtype(self) -> type:
        return _DTYPES[self.info.graph.kv_dtype]

    @property
    def precision(self) -> str:
        return self.info.graph.precision

    @property
    def kleidiai(self) -> bool:
        """False where the quantization recipe keeps ONNX Runtime's KleidiAI kernels off (the arm64-dotprod / -i8mm /
        -sve recipes: MLAS's own kernels give x86's ids, docs/arm.md); every session of the folder applies it."""
        recipe = (self.info.raw.get("quantization") or {}).get("recipe") or {}
        return recipe.get("kleidiai") is not False

    def generation_defaults(self) -> dict[str, Any]:
        """generation_config.json of the source checkpoint when the manifest lists it (so it was verified), else {};
        its token ids are checked against the vocabulary here, its sampling options where they become
        SamplingParams (gpt2edge.runtime.call_params.folder_defaults)."""
        if GENERATION_CONFIG not in self.info.files:
            return {}
        p = resolve_inside(self.path, GENERATION_CONFIG)
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise ModelFolderError(f"{p} cannot be read as JSON ({e}); re-export the model.") from e
        if not isinstance(data, dict):
            raise ModelFolderError(f"{p} is not a JSON object; re-export the model.")
        _check_token_ids(data, p, self.dims.vocab_size)
        return data

    def model_bytes(self) -> int:
        """Bytes of the graph files (the .onnx and its external data), as listed in the manifest."""
        return self.info.model_bytes()

    def kept_ids(self) -> np.ndarray | None:
        """(K,) int64 full-vocabulary ids of a trimmed head's log-prob columns, ascending; None when untrimmed."""
        v = self.info.vocab
        if v is None:
            return None
        p = resolve_inside(self.path, v.kept_ids_file)
        try:
            ids = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ModelFolderError(f"{p} cannot be read as a .npy array ({e}); trim the model again.") from e
        ok = ids.dtype == np.int64 and ids.shape == (v.kept,) and ids[0] >= 0 and ids[-1] < v.full
        if not ok or np.any(np.diff(ids) <= 0):
            raise ModelFolderError(
                f"{p} is not the ascending list of {v.kept} kept token ids below {v.full} that the manifest "
                "describes; trim the model again."
            )
        return ids


_TOKEN_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _check_token_ids(data: dict, path: Path, vocab_size: int) -> None:
    """Token ids in range, named by this file: a value the user never typed must not surface later as a
    traceback (an ONNX Runtime Gather past the vocabulary)."""
    for key in _TOKEN_KEYS:
        v = data.get(key)
        ids = v if isinstance(v, list) and key == "eos_token_id" else [v]
        if v is not None and not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            listed = " (or a list of them)" if key == "eos_token_id" else ""
            raise ModelFolderError(
                f"{path}: {key} must be a token id from 0 to {vocab_size - 1}{listed}, got {v!r}; fix the file or "
                "export the model again."
            )


def _check_graph_format(path: Path, fmt: str) -> None:
    """The runtime runs .onnx and .ort graphs; a genai folder is for onnxruntime-genai (its logits differ)."""
    if fmt == "genai":
        raise ModelFolderError(
            f"{path} is an onnxruntime-genai folder (`gpt2edge convert --format genai`); run it with "
            "onnxruntime_genai.Model, or give gpt2edge the folder it was converted from."
        )
