"""Find and load a Hugging Face GPT-2 checkpoint: a local folder (checked first) or a hub id."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpt2edge.errors import CheckpointError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# "gpt2", "openai-community/gpt2", "microsoft/DialoGPT-small": at most one slash, no path-like prefix
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class Checkpoint:
    """A loaded source model with what the manifest records about where it came from."""

    model: Any  # transformers GPT2LMHeadModel, eval mode, fp32
    tokenizer: Any  # transformers fast tokenizer
    generation_config: Any  # transformers GenerationConfig
    source: dict[str, Any] = field(default_factory=dict)


def _check_local_folder(path: Path) -> None:
    """Raise before loading anything if the folder cannot be a GPT-2 checkpoint."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} has no config.json; point -m at a Hugging Face checkpoint folder.")
    try:
        model_type = json.loads(cfg_path.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e}).") from e
    _check_model_type(model_type, str(path))
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise CheckpointError(
            f"{path} has no weights: expected one of {', '.join(WEIGHT_FILES)}. "
            "Save the model with `model.save_pretrained(path)`."
        )


def _check_model_type(model_type: str | None, where: str) -> None:
    if model_type != "gpt2":
        raise CheckpointError(
            f"{where} is a '{model_type}' model; gpt2edge exports GPT-2-family checkpoints only "
            "(config.json model_type 'gpt2': gpt2, distilgpt2, gpt2-medium/large/xl, DialoGPT, fine-tunes)."
        )


def resolve_source(source: str) -> tuple[str, str]:
    """Decide whether `source` is a local folder or a hub id; returns (kind, location)."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{source} is a file; -m takes a checkpoint folder or a hub id.")
        _check_local_folder(path)
        return "local", str(path.resolve())
    if source.startswith((".", "/", "~")) or not _HUB_ID.match(source):
        raise CheckpointError(
            f"{source} does not exist, and it is not a Hugging Face Hub id such as 'gpt2' or 'org/name' "
            "(for a hub model, note that this machine may be offline)."
        )
    return "hub", source


def load_checkpoint(source: str, revision: str | None = None, tokenizer_source: str | None = None) -> Checkpoint:
    """Load the model in fp32 eval mode, its tokenizer and generation defaults.

    Pickle weights (pytorch_model.bin) go through torch's weights-only loader: no code runs from the file.
    """
    import transformers
    from transformers import AutoConfig, GenerationConfig, GPT2LMHeadModel

    kind, location = resolve_source(source)
    try:
        config = AutoConfig.from_pretrained(location, revision=revision)
    except OSError as e:
        if kind == "hub":
            raise CheckpointError(
                f"'{source}' is not a local folder and could not be fetched from the Hugging Face Hub "
                f"(is this machine offline, or the id misspelled?): {str(e).splitlines()[0]}"
            ) from e
        raise CheckpointError(f"Cannot read the config of {source}: {e}") from e
    _check_model_type(config.model_type, source)
    try:
        model = GPT2LMHeadModel.from_pretrained(
            location, revision=revision, weights_only=True, attn_implementation="eager", dtype="float32"
        )
    except Exception as e:  # safetensors, pickle (UnpicklingError) and shape errors all land here
        raise CheckpointError(f"Cannot load the weights of {source}: {str(e).splitlines()[0]}") from e
    model.eval()

    tokenizer = load_tokenizer(tokenizer_source or location, revision=None if tokenizer_source else revision)
    if len(tokenizer) > config.vocab_size:
        raise CheckpointError(
            f"The tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size}; "
            "pass the checkpoint's own tokenizer with --tokenizer."
        )
    try:
        generation_config = GenerationConfig.from_pretrained(location, revision=revision)
    except OSError:
        generation_config = GenerationConfig.from_model_config(config)

    info: dict[str, Any] = {"model": source, "kind": kind, "transformers": transformers.__version__}
    if kind == "local":
        info["path"] = location
    else:
        info["revision"] = revision or "main"
        info["commit_hash"] = getattr(config, "_commit_hash", None)
    if tokenizer_source:
        info["tokenizer"] = tokenizer_source
    return Checkpoint(model=model, tokenizer=tokenizer, generation_config=generation_config, source=info)


def load_tokenizer(location: str, revision: str | None = None):
    """A fast (Rust) tokenizer from a checkpoint, a tokenizer folder, or bare vocab.json + merges.txt."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    try:
        tok = AutoTokenizer.from_pretrained(location, revision=revision, use_fast=True)
    except (OSError, ValueError, TypeError):
        try:
            tok = GPT2TokenizerFast.from_pretrained(location)
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(
                f"No tokenizer found in {location}; pass --tokenizer DIR (a folder with tokenizer.json, "
                "or vocab.json and merges.txt)."
            ) from e
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise CheckpointError(f"The tokenizer in {location} has no fast (tokenizer.json) form.")
    return tok
