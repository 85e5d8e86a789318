"""Prompts for `gpt2edge generate`: from -p values, stdin and prompt files, checked as UTF-8 before any work.

-f FILE is one prompt: the whole file (llama.cpp's -f). --batch-file FILE holds several, in one of these
formats, chosen by an explicit rule (never by the file's name):
- lines: one prompt per line; blank lines are skipped; the line is the prompt, without its line ending.
- jsonl: one JSON object per non-blank line, its "prompt" field (a string) is the prompt (for prompts that
  hold newlines).
- auto (default): jsonl when EVERY non-blank line is a JSON object with a string "prompt" field, else lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from gpt2edge.budget.inputs import MAX_PROMPT_BYTES, MAX_REPORT_TEXT_BYTES, read_limited, read_prefix_text
from gpt2edge.errors import GenerationError

STDIN = "-"
FORMATS = ("auto", "lines", "jsonl")


def check_utf8(text: str, where: str) -> str:
    """Refuse text that cannot be encoded as UTF-8: undecodable argv bytes (which Python on Linux passes as
    surrogate escapes U+DC80..U+DCFF) or lone surrogates (e.g. a JSON "\\ud800" escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise GenerationError(f"{where} is not valid UTF-8 ({what} at character {e.start}); pass UTF-8 text.") from None
    return text


def decode_utf8(data: bytes, where: str) -> str:
    """Bytes of a prompt file or stdin -> text; a UTF-8 byte-order mark is dropped, other bad bytes refused."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise GenerationError(
            f"{where} is not valid UTF-8 (byte 0x{data[e.start]:02x} on line {line}); save it as UTF-8."
        ) from None


def read_text_file(path: str | Path, what: str = "--text") -> str:
    """A text option's file (quantize/parity/trim-vocab --text) as UTF-8 text, or one line saying why not."""
    data, _ = read_prefix_text(path, MAX_REPORT_TEXT_BYTES, what)  # a huge or endless file: its start
    return decode_utf8(data, f"The {what} file {path}")


def read_prompt_file(source) -> bytes:
    """A prompt file (a path, or stdin's binary stream), refused beyond MAX_PROMPT_BYTES: reading stops there."""
    what = "stdin" if not isinstance(source, (str, Path)) else f"The prompt file {source}"
    return read_limited(source, MAX_PROMPT_BYTES, what, "give fewer or shorter prompts (split the file).")


def _json_prompt(line: str) -> str | None:
    """The "prompt" string of a JSON-object line, else None."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested too deep, so not a prompt object either
        return None
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    return prompt if isinstance(prompt, str) else None


def parse_prompts(text: str, fmt: str, where: str) -> list[str]:
    """The prompts of one file's text in format `fmt` (see the module docstring)."""
    if fmt not in FORMATS:
        raise GenerationError(f"Unknown prompt file format '{fmt}'; choose one of {', '.join(FORMATS)}.")
    # split on \n only: str.splitlines would also split on form feeds and U+2028 inside a prompt
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1)]
    lines = [(n, line) for n, line in lines if line.strip()]
    if not lines:
        raise GenerationError(f"{where} holds no prompts (blank lines are skipped).")
    if fmt == "auto":
        fmt = "jsonl" if all(_json_prompt(line) is not None for _, line in lines) else "lines"
    if fmt == "lines":
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        prompt = _json_prompt(line)
        if prompt is None:
            raise GenerationError(f'{where} line {n} is not a JSON object with a string "prompt" field (jsonl).')
        prompts.append(check_utf8(prompt, f"{where} line {n}"))
    return prompts


def _whole(text: str, empty: str) -> str:
    """A whole file or stdin as one prompt: one trailing newline dropped (an editor's or `echo`'s, as llama.cpp's
    -f does); refused with the message `empty` when nothing is left."""
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise GenerationError(empty)
    return text


def collect_prompts(
    values: Sequence[str],
    files: Sequence[str | Path],
    fmt: str,
    read_stdin: Callable[[], bytes],
    batch_files: Sequence[str | Path] = (),
) -> list[str]:
    """-p values (`-` = all of stdin as one prompt, one trailing newline dropped), then each -f file as one
    prompt (llama.cpp's -f; `-` = stdin), then each --batch-file's prompts in format `fmt` (one per line, or
    JSONL; `-` = stdin), in the order given. Raises before anything is loaded."""
    sources = [*values, *map(str, files), *map(str, batch_files)]
    if sum(v == STDIN for v in sources) > 1:
        raise GenerationError("stdin can be read once: give '-' to one -p, -f or --batch-file only.")
    prompts = []
    for v in values:
        if v != STDIN:
            prompts.append(check_utf8(v, "The -p prompt"))
        else:
            empty = "-p - read an empty stdin; pipe the prompt in (echo 'text' | gpt2edge ...)."
            prompts.append(_whole(decode_utf8(read_stdin(), "stdin"), empty))
    for f in map(str, files):
        data = read_stdin() if f == STDIN else read_prompt_file(f)  # bounded, as a --batch-file
        where = "stdin" if f == STDIN else f
        prompts.append(_whole(decode_utf8(data, where), f"-f {where} is empty; put the prompt in it."))
    for f in map(str, batch_files):
        if f == STDIN:
            prompts += parse_prompts(decode_utf8(read_stdin(), "stdin"), fmt, "stdin")
        else:
            prompts += parse_prompts(decode_utf8(read_prompt_file(f), str(f)), fmt, str(f))
    if not prompts:
        raise GenerationError("No prompt given: pass -p TEXT (repeatable), -p - (stdin), -f FILE or --batch-file FILE.")
    return prompts
