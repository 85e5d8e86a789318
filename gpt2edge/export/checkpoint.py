"""Find and load a Hugging Face GPT-2 checkpoint: a local folder (checked first) or a hub id.

Nothing here imports torch at module level: the source is resolved (and refused) before the heavy imports.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpt2edge.errors import CheckpointError
from gpt2edge.export.hub import cache_only
from gpt2edge.export.loading_check import check_loading_info
from gpt2edge.export.tokenizer_source import HUB_ID as _HUB_ID
from gpt2edge.export.tokenizer_source import check_matches_model, check_vocabulary
from gpt2edge.manifest.records import FORMAT, MANIFEST_NAME, MAX_MANIFEST_BYTES

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclass
class Checkpoint:
    """A loaded source model with what the manifest records about where it came from."""

    model: Any  # transformers GPT2LMHeadModel, eval mode, fp32
    tokenizer: Any  # transformers fast tokenizer
    generation_config: Any  # transformers GenerationConfig
    source: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Source:
    """Where a checkpoint is read from; `offline`: read the Hugging Face cache only, never the network."""

    kind: str  # "local" or "hub"
    location: str  # resolved folder, or the hub id
    offline: bool = False


def _check_local_folder(path: Path) -> None:
    """Raise before loading anything if the folder cannot be a GPT-2 checkpoint."""
    _refuse_export_folder(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} has no config.json; point -m at a Hugging Face checkpoint folder.")
    try:
        config = json.loads(cfg_path.read_text())
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, nested too deep
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); save the model again.") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path} is not a JSON object; save the model again.")
    model_type = config.get("model_type")
    _check_model_type(model_type, str(path))
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise CheckpointError(
            f"{path} has no weights: expected one of {', '.join(WEIGHT_FILES)}. "
            "Save the model with `model.save_pretrained(path)`."
        )


def _refuse_export_folder(path: Path) -> None:
    """An export folder has a config.json too; say what it is instead of 'has no weights'."""
    try:
        if (path / MANIFEST_NAME).stat().st_size > MAX_MANIFEST_BYTES:
            return  # not one gpt2edge wrote, and not read
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError, RecursionError):
        return
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT:
        source = manifest.get("source")
        origin = source.get("model") if isinstance(source, dict) else None
        came_from = f" (exported from {origin})" if isinstance(origin, str) and 0 < len(origin) <= 200 else ""
        raise CheckpointError(
            f"{path} is already a gpt2edge export{came_from}; -m takes the Hugging Face checkpoint it came from. "
            "To make a smaller variant of it, use `gpt2edge quantize`."
        )


def _check_model_type(model_type: str | None, where: str) -> None:
    if model_type != "gpt2":
        raise CheckpointError(
            f"{where} is a '{model_type}' model; gpt2edge exports GPT-2-family checkpoints only "
            "(config.json model_type 'gpt2': gpt2, distilgpt2, gpt2-medium/large/xl, DialoGPT, fine-tunes)."
        )


def resolve_source(source: str, revision: str | None = None) -> Source:
    """Decide whether `source` is a local folder or a hub id, and whether the hub can be used."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{source} is a file; -m takes a checkpoint folder or a hub id.")
        _check_local_folder(path)
        return Source("local", str(path.resolve()))
    if source.startswith((".", "/", "~")) or not _HUB_ID.match(source):
        raise CheckpointError(
            f"{source} does not exist, and it is not a Hugging Face Hub id such as 'gpt2' or 'org/name' "
            "(for a hub model, note that this machine may be offline)."
        )
    return Source("hub", source, offline=cache_only(source, revision, ("config.json",)))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' load report becomes a CheckpointError below; its progress bar shows on a TTY only."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_checkpoint(
    source: str, revision: str | None = None, tokenizer_source: str | None = None, resolved: Source | None = None
) -> Checkpoint:
    """Load the model in fp32 eval mode, its tokenizer and generation defaults (`resolved`: resolve_source's
    answer for `source`, when the caller already has it).

    Pickle weights (pytorch_model.bin) go through torch's weights-only loader: no code runs from the file.
    """
    from gpt2edge.extras import require_extra

    require_extra("export", "loading a PyTorch checkpoint")
    import transformers
    from transformers import AutoConfig, GenerationConfig, GPT2LMHeadModel

    src = resolved or resolve_source(source, revision)
    hub = dict(revision=revision, local_files_only=src.offline)
    try:
        config = AutoConfig.from_pretrained(src.location, **hub)
    except OSError as e:
        if src.kind == "hub":
            raise CheckpointError(
                f"'{source}' is not a local folder and could not be fetched from the Hugging Face Hub "
                f"(is this machine offline, or the id misspelled?): {str(e).splitlines()[0]}"
            ) from e
        raise CheckpointError(f"Cannot read the config of {source}: {e}") from e
    _check_model_type(config.model_type, source)
    # the tokenizer before the weights: an empty one, or one not of this model, is refused before the load
    tokenizer = load_tokenizer(*_tokenizer_location(src, revision, tokenizer_source))
    check_matches_model(tokenizer, config, source)
    try:
        with _quiet_transformers():
            model, info = GPT2LMHeadModel.from_pretrained(
                src.location,
                **hub,
                weights_only=True,
                attn_implementation="eager",
                dtype="float32",
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported by check_loading_info, with both shapes
            )
    except Exception as e:  # safetensors, pickle (UnpicklingError) and shape errors all land here
        raise CheckpointError(f"Cannot load the weights of {source}: {str(e).splitlines()[0]}") from e
    check_loading_info(info, source, config.n_layer, list(model.state_dict()))
    model.eval()

    try:
        generation_config = GenerationConfig.from_pretrained(src.location, **hub)
    except OSError:
        generation_config = GenerationConfig.from_model_config(config)

    info_out: dict[str, Any] = {"model": source, "kind": src.kind, "transformers": transformers.__version__}
    if src.kind == "local":
        info_out["path"] = src.location
    else:
        info_out["revision"] = revision or "main"
        info_out["commit_hash"] = getattr(config, "_commit_hash", None)
    if tokenizer_source:
        info_out["tokenizer"] = tokenizer_source
    return Checkpoint(model=model, tokenizer=tokenizer, generation_config=generation_config, source=info_out)


def _tokenizer_location(src: Source, revision: str | None, tokenizer_source: str | None) -> tuple:
    """(location, revision, local_files_only) of the tokenizer: the checkpoint's own, or --tokenizer's."""
    if tokenizer_source is None:
        return src.location, revision, src.offline
    if Path(tokenizer_source).expanduser().exists() or not _HUB_ID.match(tokenizer_source):
        return tokenizer_source, None, False
    return tokenizer_source, None, cache_only(tokenizer_source, None, _TOKENIZER_FILES)


def load_tokenizer(location: str, revision: str | None = None, local_files_only: bool = False):
    """A fast (Rust) tokenizer from a checkpoint, a tokenizer folder, or bare vocab.json + merges.txt."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    try:
        tok = AutoTokenizer.from_pretrained(
            location, revision=revision, use_fast=True, local_files_only=local_files_only
        )
    except (OSError, ValueError, TypeError):
        try:
            tok = GPT2TokenizerFast.from_pretrained(location, local_files_only=local_files_only)
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(
                f"No tokenizer found in {location}; pass --tokenizer DIR (a folder with tokenizer.json, "
                "or vocab.json and merges.txt)."
            ) from e
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise CheckpointError(f"The tokenizer in {location} has no fast (tokenizer.json) form.")
    check_vocabulary(tok, location)  # what transformers builds from a folder or hub id it found nothing in
    return tok
