"""How a Generator call's sampling arguments are merged with generation_config.json: the folder's defaults
checked as SamplingParams, the keys that map onto them, the knobs that turn sampling on, and stop / banned strings
as checked tuples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from gpt2edge.api_args import strings_arg
from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.manifest.records import GENERATION_CONFIG
from gpt2edge.runtime.decoding.sampling_params import SamplingParams
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.tokenizer import check_unicode

# SamplingParams' fields the Generator resolves from its own arguments (eos_token_id from ignore_eos, stop from
# strings, seed), never from generation_config.json or an override
RESOLVED = ("eos_token_id", "stop", "seed")
# the request's knobs: generation_config.json keys and Generator call overrides, one-to-one onto SamplingParams
# (derived from the record, so a new field is a knob everywhere at once; tests/runtime/test_request_record.py checks the
# CLI, the server and the browser runtime against it)
CONFIG_KEYS = tuple(f.name for f in fields(SamplingParams) if f.name not in RESOLVED)
# knobs that act only when sampling: giving one turns sampling on unless do_sample is given
SAMPLING_KNOBS = ("temperature", "top_k", "top_p", "min_p", "typical_p")


def folder_defaults(folder: ModelFolder) -> dict[str, Any]:
    """The folder's generation_config.json (its token ids checked by the folder), every sampling option in it
    checked as SamplingParams and named by the file: a value the user never typed must not surface later as a
    traceback or as an error about a flag they did not pass."""
    data = folder.generation_defaults()
    knobs = {k: data[k] for k in CONFIG_KEYS if data.get(k) is not None}
    try:
        SamplingParams(**knobs)
    except GenerationError as e:
        raise ModelFolderError(f"{folder.path / GENERATION_CONFIG}: {e} Fix the file or export the model again.") from e
    return data


def as_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def stop_strings(stop: str | Sequence[str] | None, what: str = "Stop strings") -> tuple[str, ...]:
    """A plain string is one stop string (not one per character); a list gives several."""
    stops = strings_arg(stop, "stop" if what == "Stop strings" else "ban")  # a TypeError names a wrong type
    bad = [s for s in stops if not isinstance(s, str) or not s]
    if bad:
        raise GenerationError(f"{what} must be non-empty strings, got {bad[0]!r}.")
    return tuple(check_unicode(s, f"{what[:-1]} {s!r}") for s in stops)


def merged_values(defaults: dict[str, Any], overrides: dict[str, Any], banned: list[tuple[int, ...]]) -> dict[str, Any]:
    """SamplingParams' knobs: generation_config.json's `defaults`, then the call's non-None `overrides` (an
    unknown name raises), then the `banned` id sequences joined to any bad_words_ids."""
    unknown = set(overrides) - set(CONFIG_KEYS)
    if unknown:
        raise GenerationError(f"Unknown generation parameter(s): {', '.join(sorted(unknown))}.")
    values: dict[str, Any] = {k: defaults[k] for k in CONFIG_KEYS if defaults.get(k) is not None}
    given = {k: v for k, v in overrides.items() if v is not None}
    if "do_sample" not in given and any(k in given for k in SAMPLING_KNOBS):
        given["do_sample"] = True
    values.update(given)
    if banned:
        values["bad_words_ids"] = tuple(dict.fromkeys([*map(tuple, values.get("bad_words_ids") or ()), *banned]))
    return values
