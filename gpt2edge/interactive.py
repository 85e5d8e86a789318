"""`gpt2edge generate DIR -i`: a line-by-line session on one KV cache (llama.cpp's `-i`/`--interactive`).

Each line read from stdin is appended to the context as typed (without its newline; an empty line adds
nothing and lets the model go on) and the model's continuation is streamed to stdout, followed by a newline.
Everything else (the banner, the `> ` prompt on a terminal, one status line per turn, context-overflow
notices) goes to stderr, so stdout holds only the model's text.

Commands: /reset forgets the context, /save FILE writes the context and its KV cache to FILE and /load FILE
restores one (gpt2edge.runtime.session_file; a refused file prints one `error:` line and the session goes on
unchanged), /quit (or end of input) exits with status 0. Ctrl-C while the model
writes ends that turn (what it wrote stays in the context) and returns to the prompt; Ctrl-C at the prompt
exits with status 130, the shell's code for an interrupt. No traceback either way.
"""

from __future__ import annotations

import sys
from contextlib import closing
from typing import Any, TextIO

from gpt2edge.errors import Gpt2EdgeError
from gpt2edge.runtime.conversation import ContextOverflow, Conversation
from gpt2edge.runtime.generator import Generator

BANNER = (
    "[interactive: each line extends the context and the model continues it; an empty line lets it go on; "
    "/reset clears the context; /save FILE, /load FILE keep it; /quit or end of input exits]"
)


def run_interactive(
    gen: Generator,
    first: str | None,
    options: dict[str, Any],
    stdin: TextIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run the loop until /quit, end of input or Ctrl-C at the prompt; returns the exit status. `first` (the -p
    text, if any) is the first turn; `options` are Conversation.stream's keyword arguments."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr

    def notice(overflow: ContextOverflow) -> None:
        print(f"[{overflow.message()}]", file=err, flush=True)

    session = gen.session(on_overflow=notice)
    session.stream(**options).close()  # checks the options (raises) before the first line is read
    try:
        print(BANNER, file=err, flush=True)
        line = first
        while True:
            if line is None:
                line = read_line(stdin, err)
                if line is None or line.strip() == "/quit":
                    return 0
                if line.strip() == "/reset":
                    session.reset()
                    print("[context cleared]", file=err, flush=True)
                    line = None
                    continue
                if command(session, line, err):
                    line = None
                    continue
            turn(session, line, options, out, err)  # Ctrl-C in a turn ends the turn only
            line = None
    except KeyboardInterrupt:  # at the prompt (or between turns): leave
        print(file=err, flush=True)
        return 130


def command(session: Conversation, line: str, err: TextIO) -> bool:
    """Run a /save or /load line; False for any other line. An error is one line on `err`; the session goes on."""
    name, _, arg = line.strip().partition(" ")
    if name not in ("/save", "/load"):
        return False
    arg = arg.strip()
    try:
        if not arg:
            raise Gpt2EdgeError(f"{name} needs a file name: {name} FILE.")
        if name == "/save":
            session.save(arg)
            print(f"[saved {len(session.token_ids)} tokens to {arg}]", file=err, flush=True)
        else:
            session.load(arg)
            print(f"[loaded {len(session.token_ids)} tokens from {arg}]", file=err, flush=True)
    except Gpt2EdgeError as e:
        print(f"error: {e}", file=err, flush=True)
    return True


def read_line(stdin: TextIO, err: TextIO) -> str | None:
    """One line without its line ending, or None at end of input; shows `> ` on stderr on a terminal."""
    if stdin.isatty():
        print("> ", end="", file=err, flush=True)
    line = stdin.readline()
    return None if not line else line.rstrip("\n").rstrip("\r")


def turn(session: Conversation, text: str, options: dict[str, Any], out: TextIO, err: TextIO) -> None:
    """Stream one continuation of `text` to `out`, then one status line to `err`."""
    result: list = []
    try:
        with closing(session.stream(text, result=result, **options)) as pieces:
            for piece in pieces:
                out.write(piece)
                out.flush()
    except KeyboardInterrupt:  # raised in this loop rather than in the model: the turn ends here all the same
        pass
    out.write("\n")
    out.flush()
    context = f"context {len(session.token_ids)}/{session.n_positions}"
    if not result:
        print(f"[interrupted | {context}]", file=err, flush=True)
        return
    r = result[0]
    print(
        f"[{r.finish_reason}: {len(r.token_ids)} tokens | prefill {session.last_prefill_tokens} new tokens in "
        f"{r.timings['prefill_ms']:.1f} ms | {context}]",
        file=err,
        flush=True,
    )
