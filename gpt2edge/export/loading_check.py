"""Every parameter of the exported graph must come from the checkpoint: the loading report of transformers,
turned into one CheckpointError that says what disagrees (missing, unexpected or mis-shaped weights)."""

from __future__ import annotations

import re
from typing import Any

from gpt2edge.errors import CheckpointError

# buffers some checkpoints carry (causal-mask tables): they hold no weights, so their absence is fine
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_LAYER = re.compile(r"\.h\.(\d+)\.")


def _layers(keys) -> set[int]:
    return {int(m.group(1)) for k in keys if (m := _LAYER.search(k))}


def _layers_in_weights(missing: list[str], unexpected: list[str], model_keys: list[str]) -> set[int]:
    """Block indices the checkpoint holds: the model's, less those missing whole, plus unexpected ones."""
    by_layer: dict[int, set[str]] = {}
    for k in model_keys:
        if m := _LAYER.search(k):
            by_layer.setdefault(int(m.group(1)), set()).add(k)
    whole = {i for i, keys in by_layer.items() if keys <= set(missing)}
    return (set(by_layer) - whole) | _layers(unexpected)


def check_loading_info(info: dict[str, Any], source: str, n_layer: int, model_keys: list[str]) -> None:
    """Every parameter must come from the checkpoint: refuse missing, unexpected and mis-shaped weights.

    transformers would initialise missing ones at random (and validation against that same random model
    would pass); a tied LM head is not missing (it is the embedding), mask buffers carry no weights."""
    missing = sorted(k for k in info["missing_keys"] if not k.endswith(_BUFFER_SUFFIXES))
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.endswith(_BUFFER_SUFFIXES))
    mismatched = sorted(info["mismatched_keys"])
    if not (missing or unexpected or mismatched):
        return
    problems = []
    # the common cause, a wrong n_layer, named outright
    held = len(_layers_in_weights(missing, unexpected, model_keys))
    if held != n_layer:
        problems.append(f"config.json says n_layer={n_layer} but the weights hold {held} layers")
    if mismatched:
        key, in_weights, from_config = mismatched[0]
        problems.append(
            f"{len(mismatched)} weight(s) have another shape than config.json implies "
            f"(e.g. {key}: {tuple(in_weights)} in the weights, {tuple(from_config)} from the config)"
        )
    if missing:
        problems.append(f"{len(missing)} weight(s) are missing (e.g. {', '.join(missing[:2])})")
    if unexpected:
        problems.append(f"{len(unexpected)} weight(s) are not part of the model (e.g. {', '.join(unexpected[:2])})")
    raise CheckpointError(
        f"The weights of {source} do not match its config.json: {'; '.join(problems)}. "
        "Fix config.json (n_layer, n_embd, n_head, vocab_size, n_positions) or re-save with save_pretrained."
    )
