"""Every option of every command takes a checked value: an enumerated one is a click.Choice of the library's own
constant, a number is a click.IntRange / FloatRange (finite), and only genuinely free text (prompts, paths,
names, hub ids) is a plain string. A bad value is then a usage error (exit 2) naming the option, before any
folder is read."""

from __future__ import annotations

import math

import click
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main

# options whose value is free text by nature: a prompt, a name, a hub id or revision, an address, a shape spec
FREE_TEXT = {
    ("export", "source"),  # local folder or hub id
    ("export", "revision"),
    ("export", "tokenizer"),  # local folder or hub id
    ("export", "static"),  # BATCHxCHUNKxCAPACITY, parsed by export.options
    ("random-checkpoint", "tokenizer"),
    ("generate", "prompts"),
    ("generate", "ban"),
    ("generate", "stop"),
    ("generate", "json_schema"),  # a file or the schema's text, checked by runtime.constraints
    ("generate", "regex"),  # compiled (and refused in one line) by the engine
    ("generate", "choice"),
    ("parity", "source"),
    ("bench", "source"),
    ("serve", "host"),
    ("serve", "model_name"),
    ("serve", "api_key"),  # any printable text is a key (ServeConfig checks it)
    ("serve", "ray_address"),
}


def value_options():
    """(command name, option) for every option of every command that takes a value (flags excluded)."""
    for name, command in sorted(main.commands.items()):
        for p in command.params:
            if isinstance(p, click.Option) and not p.is_flag and not p.count:
                yield name, p


OPTIONS = list(value_options())
IDS = [f"{c} {max(p.opts, key=len)}" for c, p in OPTIONS]


@pytest.mark.parametrize("command, option", OPTIONS, ids=IDS)
def test_every_option_takes_a_checked_value(command, option):
    t = option.type
    if isinstance(t, click.types.StringParamType):
        assert (command, option.name) in FREE_TEXT, (
            f"{command} {option.opts[0]} takes free text: make it a click.Choice of the library's values (or add it "
            "to FREE_TEXT if any text is valid)"
        )
    if isinstance(t, click.types.IntParamType):
        assert isinstance(t, click.IntRange), f"{command} {option.opts[0]} takes any integer: give it an IntRange"
    if isinstance(t, click.types.FloatParamType):
        assert isinstance(t, click.FloatRange), f"{command} {option.opts[0]} takes any float: give it a FloatRange"
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(click.BadParameter):
                t.convert(bad, option, None)  # nan passes every comparison of a plain FloatRange
    if isinstance(t, click.Choice):
        assert t.choices, f"{command} {option.opts[0]} has no choices"


def test_free_text_list_names_only_real_options():
    """A stale FREE_TEXT entry would hide nothing, but would read as if that option existed."""
    names = {(c, p.name) for c, p in OPTIONS}
    assert FREE_TEXT <= names, FREE_TEXT - names


def library_choices() -> dict[tuple[str, str], tuple]:
    """(command, option) -> the library constant its click.Choice must offer (a second list would drift)."""
    from gpt2edge.convert import FORMATS
    from gpt2edge.export.options import KV_DTYPE_CHOICES
    from gpt2edge.export.random_checkpoint import SIZES
    from gpt2edge.manifest import HEAD_MODES, KV_CACHE_MODES
    from gpt2edge.prompt_input import FORMATS as PROMPT_FORMATS
    from gpt2edge.quantize.handler import ACCURACY_LEVELS, HEAD_BITS, MODES
    from gpt2edge.quantize.primitives import BLOCK_SIZES
    from gpt2edge.quantize.targets import TARGET_CHOICES
    from gpt2edge.runtime.decoding.sampling_params import EARLY_STOPPING_NAMES
    from gpt2edge.runtime.model.ort_session import PROVIDERS
    from gpt2edge.runtime.score import METHODS
    from gpt2edge.serve.config import SCHEDULERS
    from gpt2edge.sparse.modes import SPARSE_MODES

    devices = {(c, "device"): tuple(PROVIDERS) for c in ("generate", "bench", "score", "serve")}
    return {
        ("export", "head"): HEAD_MODES,
        ("export", "kv_cache"): KV_CACHE_MODES,
        ("export", "kv_dtype"): KV_DTYPE_CHOICES,
        ("quantize", "kv_dtype"): KV_DTYPE_CHOICES,
        ("random-checkpoint", "size"): tuple(SIZES),
        ("quantize", "mode"): MODES,
        ("quantize", "block_size"): BLOCK_SIZES,
        ("quantize", "accuracy_level"): ACCURACY_LEVELS,
        ("quantize", "head_bits"): HEAD_BITS,
        ("quantize", "target"): TARGET_CHOICES,
        ("convert", "fmt"): FORMATS,
        ("generate", "file_format"): PROMPT_FORMATS,
        ("generate", "early_stopping"): EARLY_STOPPING_NAMES,
        ("score", "method"): METHODS,
        ("serve", "scheduler"): SCHEDULERS,
        ("sparse-head", "mode"): SPARSE_MODES,
        **devices,
    }


CHOICES = [(c, p) for c, p in OPTIONS if isinstance(p.type, click.Choice)]


@pytest.mark.parametrize("command, option", CHOICES, ids=[f"{c} {max(p.opts, key=len)}" for c, p in CHOICES])
def test_every_choice_offers_the_librarys_own_values(command, option):
    expected = library_choices().get((command, option.name))
    assert expected is not None, f"{command} {option.opts[-1]}: name the library constant its choices come from"
    assert list(option.type.choices) == list(expected)


def test_convert_format_is_the_library_formats():
    from gpt2edge.convert import FORMATS

    option = next(p for p in main.commands["convert"].params if p.name == "fmt")
    assert isinstance(option.type, click.Choice) and tuple(option.type.choices) == tuple(FORMATS)
    help_text = CliRunner().invoke(main, ["convert", "--help"]).output
    assert f"[{'|'.join(FORMATS)}]" in help_text and "TEXT" not in help_text, help_text


def test_a_bad_format_is_a_usage_error_before_the_folder_is_read(tmp_path):
    out = CliRunner().invoke(main, ["convert", str(tmp_path / "none"), "-o", str(tmp_path / "o"), "--format", "tflite"])
    assert out.exit_code == 2, out.output
    assert "Invalid value for '--format'" in out.output and "'ort'" in out.output and "Traceback" not in out.output
    assert not (tmp_path / "o").exists()


# one out-of-range value per numeric option that took any number before
BAD_VALUES = [
    ("export", ["-m", "x", "OUT", "--atol", "0"]),
    ("export", ["-m", "x", "OUT", "--atol", "nan"]),
    ("random-checkpoint", ["OUT", "--seed", "-1"]),
    ("trim-vocab", ["DIR", "-o", "OUT", "--top", "0"]),
    ("parity", ["DIR", "DIR", "--max-kl", "-1"]),
    ("parity", ["DIR", "DIR", "--min-top1", "1.5"]),
    ("parity", ["DIR", "DIR", "--max-logprob-diff", "nan"]),
    ("parity", ["DIR", "DIR", "--min-greedy-match", "-1"]),
    ("bench", ["DIR", "--prompt-lookup", "0"]),
    ("bench", ["DIR", "--prompt-lookup", "2", "--draft-tokens", "0"]),
    ("generate", ["DIR", "-p", "x", "--repetition-penalty", "0"]),
    ("generate", ["DIR", "-p", "x", "--num-beams", "0"]),
    ("generate", ["DIR", "-p", "x", "--num-return-sequences", "0"]),
    ("generate", ["DIR", "-p", "x", "--length-penalty", "nan"]),
    ("generate", ["DIR", "-p", "x", "--temperature", "inf"]),
    ("generate", ["DIR", "-p", "x", "--json", "--logprobs", "-1"]),
    ("generate", ["DIR", "-p", "x", "--prompt-lookup", "0"]),
    ("generate", ["DIR", "-p", "x", "--prompt-lookup", "2", "--draft-tokens", "0"]),
    ("serve", ["DIR", "--max-batch", "0"]),
    ("serve", ["DIR", "--max-queue", "0"]),
    ("serve", ["DIR", "--max-n", "0"]),
    ("serve", ["DIR", "--max-body-kb", "0"]),
    ("serve", ["DIR", "--batch-wait-ms", "5000"]),
    ("serve", ["DIR", "--threads", "0"]),
    ("serve", ["DIR", "--ray", "--replicas", "0"]),
    ("serve", ["DIR", "--ray", "--replica-cpus", "0"]),
]


@pytest.mark.parametrize("command, args", BAD_VALUES, ids=[f"{c} {' '.join(a[-2:])}" for c, a in BAD_VALUES])
def test_out_of_range_numbers_are_usage_errors_naming_the_option(tmp_path, command, args):
    """Refused by click (exit 2) before any folder is opened: the folder given does not even exist."""
    names = {"DIR": str(tmp_path / "missing"), "OUT": str(tmp_path / "out")}
    out = CliRunner().invoke(main, [command, *(names.get(a, a) for a in args)])
    flag = next(a for a in reversed(args) if a.startswith("--"))
    assert out.exit_code == 2, out.output
    # an option with a short alias is named "'-s' / '--seed'"
    assert "Invalid value for '" in out.output and f"'{flag}'" in out.output and "Traceback" not in out.output
    assert not (tmp_path / "out").exists()


def test_finite_ranges_still_take_ordinary_values():
    from gpt2edge.cli.common import finite_range

    t = finite_range(min=0, min_open=True)
    assert t.convert("1e-4", None, None) == pytest.approx(1e-4)
    assert math.isfinite(t.convert("3", None, None))
    with pytest.raises(click.BadParameter, match="finite"):
        t.convert("inf", None, None)
