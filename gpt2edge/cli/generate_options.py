"""The options of `gpt2edge generate`, declared once: the command applies them with `@generate_options`.

Their order here is the order of `gpt2edge generate --help`. The checks on how they combine live with the
command (gpt2edge.cli.generate).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from gpt2edge.cli.common import DEVICE_HELP, DEVICES, FULL_VERIFY_HELP, SEEDS, THREADS, THREADS_HELP, finite_range
from gpt2edge.prompt_input import FORMATS
from gpt2edge.runtime.decoding.sampling_params import EARLY_STOPPING_NAMES


class _BiasPair(click.ParamType):
    """ID=BIAS -> (id, bias): a token id >= 0 and a finite bias in [-100, 100] (OpenAI's range)."""

    name = "ID=BIAS"

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201  (click's signature)
        if isinstance(value, tuple):
            return value
        tid, _, bias = str(value).partition("=")
        try:
            pair = (int(tid), float(bias))
        except ValueError:
            self.fail(f"{value!r} is not ID=BIAS (e.g. 50256=-100)", param, ctx)
        if pair[0] < 0 or not -100 <= pair[1] <= 100:  # nan fails the comparison too
            self.fail(f"{value!r}: the id must be >= 0 and the bias in [-100, 100]", param, ctx)
        return pair


def _logit_bias(ctx: click.Context, param: click.Parameter, values: tuple) -> dict[int, float] | None:
    """--logit-bias ID=BIAS (repeatable) -> {id: bias} (a later one for the same id wins)."""
    return dict(values) or None


def _cfg_default(value: object) -> str:
    return f"[default: the model's generation_config.json, else {value}]"


OPTIONS = [
    click.argument("model_dir", type=click.Path(path_type=Path)),
    click.option(
        "-p",
        "--prompt",
        "prompts",
        multiple=True,
        help="Prompt text; repeat for a batch. '-' reads one prompt from stdin (one trailing newline dropped).",
    ),
    click.option(
        "-f",
        "--file",
        "--prompt-file",
        "prompt_files",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False, allow_dash=True),
        help="The whole UTF-8 file is one prompt, as llama.cpp's -f (one trailing newline dropped; '-': stdin); "
        "repeat for a batch. For one prompt per line or JSONL use --batch-file.",
    ),
    click.option(
        "--batch-file",
        "batch_files",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False, allow_dash=True),
        help="Several prompts from a UTF-8 file ('-': stdin), see --format; repeatable, after the -p and -f prompts.",
    ),
    click.option(
        "--format",
        "file_format",
        type=click.Choice(FORMATS),
        default="auto",
        show_default=True,
        help="--batch-file files. lines: one prompt per non-blank line. jsonl: one JSON object per non-blank line, its "
        '"prompt" string. auto: jsonl when every non-blank line is such an object, else lines.',
    ),
    click.option(
        "--sequential",
        is_flag=True,
        help="Generate the prompts one after another (each streamed, or with beam search printed once done), not as "
        "one batch.",
    ),
    click.option(
        "-n",
        "--max-new-tokens",
        "--n-predict",  # llama.cpp's spelling
        type=click.IntRange(min=1),
        default=None,
        help="Tokens to generate " + _cfg_default(32) + ".",
    ),
    click.option(
        "--min-new-tokens",
        type=click.IntRange(min=0),
        default=None,
        help="Suppress EOS until this many tokens " + _cfg_default(0) + ".",
    ),
    click.option(
        "--do-sample/--greedy",
        default=None,
        help="Sample the next token, or take the most likely one " + _cfg_default("greedy") + ". "
        "--temperature, --top-k, --top-p and --seed only act when sampling; given without it, a notice on stderr "
        "says they are ignored.",
    ),
    click.option(
        "--temperature",
        "--temp",  # llama.cpp's spelling
        type=finite_range(min=0),
        default=None,
        help="Sampling temperature; 0 = greedy " + _cfg_default(1.0) + ".",
    ),
    click.option(
        "--top-k",
        type=click.IntRange(min=0),
        default=None,
        help="Sample among the k most likely tokens; 0 = all " + _cfg_default(50) + ".",
    ),
    click.option(
        "--top-p",
        type=finite_range(0, 1, min_open=True),
        default=None,
        help="Sample in the smallest set of tokens holding this probability mass, in (0, 1] " + _cfg_default(1.0) + ".",
    ),
    click.option(
        "--repetition-penalty",
        "--repeat-penalty",  # llama.cpp's spelling
        type=finite_range(min=0, min_open=True),
        default=None,
        help="> 1 discourages repeats, greedy or sampling " + _cfg_default(1.0) + ".",
    ),
    click.option(
        "--min-p",
        type=finite_range(0, 1, min_open=True),
        default=None,
        help="Sample among tokens at least this fraction of the best one's probability " + _cfg_default("off") + ".",
    ),
    click.option(
        "--typical-p",
        type=finite_range(0, 1, min_open=True),
        default=None,
        help="Locally typical sampling mass in (0, 1] " + _cfg_default(1.0) + ".",
    ),
    click.option(
        "--no-repeat-ngram-size",
        type=click.IntRange(min=0),
        default=None,
        help="Never repeat an n-gram of this size, greedy or sampling; 0 = off " + _cfg_default(0) + ".",
    ),
    click.option(
        "--presence-penalty",
        type=finite_range(-2, 2),
        default=None,
        help="OpenAI's: subtract this from every token already generated, in [-2, 2] [default: 0].",
    ),
    click.option(
        "--frequency-penalty",
        type=finite_range(-2, 2),
        default=None,
        help="OpenAI's: subtract this times each token's count so far, in [-2, 2] [default: 0].",
    ),
    click.option(
        "--logit-bias",
        multiple=True,
        type=_BiasPair(),
        callback=_logit_bias,
        help="Add BIAS in [-100, 100] to token ID's score (repeatable; -100 bans it, 100 forces it).",
    ),
    click.option(
        "--stop-token-id",
        "stop_token_ids",
        multiple=True,
        type=click.IntRange(min=0),
        help="End a sequence when this token id is generated (repeatable), as end-of-text does.",
    ),
    click.option("--ban", multiple=True, help="Never generate this text (repeatable; also with a leading space)."),
    click.option(
        "-s", "--seed", type=SEEDS, default=None, help="Seed of the sampler: same seed, same tokens [default: random]."
    ),
    click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); not included in the output."),
    click.option(
        "-e",
        "--escape",
        is_flag=True,
        help="Read \\n \\r \\t \\' \\\" \\\\ and \\xHH in -p and --stop as the characters they name (llama.cpp's -e).",
    ),
    click.option("--ignore-eos", is_flag=True, help="Keep going past the end-of-text token."),
    click.option("--truncate", is_flag=True, help="Keep the end of a prompt that does not fit instead of failing."),
    click.option(
        "--num-beams",
        type=click.IntRange(min=1),
        default=None,
        help="Beam search with this many beams (1 = off) [default: the model's generation_config.json, else 1].",
    ),
    click.option(
        "--num-return-sequences",
        type=click.IntRange(min=1),
        default=None,
        help="Sequences per prompt (<= --num-beams) [default: the model's generation_config.json, else 1].",
    ),
    click.option(
        "--length-penalty", type=finite_range(), default=None, help="Beam score = logprob / len**this [default: 1.0]."
    ),
    click.option(
        "--early-stopping",
        type=click.Choice(EARLY_STOPPING_NAMES, case_sensitive=False),
        default=None,
        help="When beam search stops (transformers' early_stopping) [default: false].",
    ),
    click.option("--device", type=DEVICES, default="cpu", show_default=True, help=DEVICE_HELP),
    click.option("-t", "--threads", type=THREADS, default=None, help=THREADS_HELP),
    click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files (large models)."),
    click.option("--verify", "full_verify", is_flag=True, help=FULL_VERIFY_HELP),
    click.option("--no-stream", is_flag=True, help="Print the text once it is complete."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (implies --no-stream)."),
    click.option(
        "--logprobs",
        type=click.IntRange(min=0),
        default=None,
        help="With --json: each token's log-prob and the N most likely (0 = the chosen token only).",
    ),
    click.option("-i", "--interactive", is_flag=True, help="Each line of stdin extends the context; /reset, /quit."),
    # structured output (docs/structured.md): at most one of these; names as llama.cpp spells them where it has them
    click.option(
        "--json-schema",
        "json_schema",
        default=None,
        metavar="FILE|JSON",
        help="The output is JSON valid under this JSON Schema (a file, or the schema's text).",
    ),
    click.option("--json-object", is_flag=True, help="The output is a JSON object (any)."),
    click.option("--regex", default=None, metavar="RE", help="The whole output matches this regular expression."),
    click.option(
        "--grammar",
        "--grammar-file",
        "grammar",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="The output is in this grammar's language: a llama.cpp GBNF file (.gbnf, or `::=` rules) or Lark.",
    ),
    click.option("--choice", multiple=True, help="The output is exactly one of these strings (repeatable)."),
    click.option(
        "--draft",
        type=click.Path(path_type=Path),
        default=None,
        help="Speculative decoding with this draft model folder (same tokenizer, smaller model).",
    ),
    click.option(
        "--prompt-lookup",
        type=click.IntRange(min=1),
        default=None,
        help="Speculative decoding with drafts copied from the context: the longest n-gram to match (e.g. 2).",
    ),
    click.option(
        "--draft-tokens",
        type=click.IntRange(min=1),
        default=None,
        help="Draft tokens per target step [default: adaptive].",
    ),
]


def generate_options(fn: Callable) -> Callable:
    """Apply OPTIONS to the command function, the first one outermost (as a stack of decorators would)."""
    for option in reversed(OPTIONS):
        fn = option(fn)
    return fn
