"""Checks on the tokenizer a checkpoint is exported (or a random checkpoint is made) with, before any work.

transformers builds an *empty* GPT-2 tokenizer (vocabulary 0, only <|endoftext|>) from a folder with no
tokenizer files, from a missing path, and from a hub id it could not fetch; the export then writes a
tokenizer.json that encodes every prompt to nothing. These checks refuse that, and a tokenizer that does not
belong to the model's embedding, in one line each. No torch or transformers import at module level.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gpt2edge.errors import CheckpointError

# a folder holds a tokenizer when it has one of these sets of files (the fast form, or GPT-2's BPE pair)
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"))
_WANTED = "a folder with tokenizer.json, or vocab.json and merges.txt"
OWN_FIX = f"pass --tokenizer DIR ({_WANTED})"
# "gpt2", "openai-community/gpt2", "microsoft/DialoGPT-small": at most one slash, no path-like prefix
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_tokenizer(location: str) -> bool:
    """A --tokenizer value that names no local path but reads as a hub id ('gpt2', 'org/name')."""
    return not Path(location).expanduser().exists() and bool(HUB_ID.match(location))


def check_tokenizer_folder(
    location: str | Path, what: str = "--tokenizer", hub_ok: bool = False, fix: str = f"pass {_WANTED}"
) -> None:
    """Refuse a missing path, a file, or a folder with no tokenizer files (raises CheckpointError).

    `what` names the argument in the message, `fix` says what to do; `hub_ok`: a value that reads as a hub id
    is left to the hub."""
    if hub_ok and is_hub_tokenizer(str(location)):
        return
    path = Path(location).expanduser()
    # a missing path: transformers would read it as a hub id, fail, and fall back to an empty tokenizer
    if not path.exists():
        hub = " and is not a Hugging Face Hub id" if hub_ok else ""
        raise CheckpointError(f"{what} {location} does not exist{hub}; {fix}.")
    if not path.is_dir():
        raise CheckpointError(f"{what} {location} is a file; pass the folder that holds it ({_WANTED}).")
    if not any(all((path / name).is_file() for name in names) for names in TOKENIZER_FILE_SETS):
        raise CheckpointError(f"{what} {location} has no tokenizer files; {fix}.")


def check_vocabulary(tok: Any, location: str) -> None:
    """A loaded tokenizer with no vocabulary of its own (only added special tokens) encodes text to nothing."""
    base = tok.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    if base == 0:
        raise CheckpointError(
            f"The tokenizer in {location} has an empty vocabulary ({len(tok)} special token(s), no text tokens): "
            f"it would encode every prompt to nothing; pass {_WANTED}."
        )


def _ids(value: Any) -> list[int]:
    """A config's eos/bos id: an int, a list of ints, or unset."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in items if isinstance(v, int) and not isinstance(v, bool)]


def check_matches_model(tok: Any, config: Any, source: str) -> None:
    """The tokenizer must belong to the model's embedding: no id past its rows, and the model's end-of-text
    (and start) id inside the tokenizer, naming the tokenizer's own end-of-text token when it has one."""
    n, rows = len(tok), int(config.vocab_size)
    fix = "pass the checkpoint's own tokenizer with --tokenizer"
    # bigger: the tokenizer produces ids the embedding has no row for
    if n > rows:
        raise CheckpointError(f"The tokenizer has {n} tokens but the model only {rows}; {fix}.")
    # far smaller (a padded embedding is fine): the model's special ids must be tokens of this tokenizer
    for key in ("eos_token_id", "bos_token_id"):
        for i in _ids(getattr(config, key, None)):
            if i >= n:
                raise CheckpointError(
                    f"The model's {key} {i} is past the tokenizer's {n} tokens (its embedding has {rows} rows): "
                    f"the tokenizer is not the model's; {fix}."
                )
    eos, own = _ids(getattr(config, "eos_token_id", None)), getattr(tok, "eos_token_id", None)
    if eos and isinstance(own, int) and own not in eos:
        raise CheckpointError(
            f"The tokenizer's end-of-text token {tok.eos_token!r} is id {own} but the model's eos_token_id is "
            f"{eos[0]}: the tokenizer is not the model's; {fix}."
        )
