"""The docs' command lines against the live CLI: every `gpt2edge COMMAND ...` in a fenced code block (or a code
span) of README.md and docs/*.md names a real command and only options that command has, read from the click
command objects, not from --help text or a list kept here; and each command's usage synopsis lists all of its
options but the few in ALLOWED_OMISSIONS."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import click
import pytest

from gpt2edge.cli import main
from tests.support.docs_markdown import ROOT, doc_files, drop_quoted, fenced_blocks, strip_comment

# Options a synopsis may leave out on purpose, with why. Aliases need no entry: naming any one spelling of an
# option (--temperature or --temp) counts for all.
ALLOWED_OMISSIONS: dict[str, dict[str, str]] = {}

# `gpt2edge word` (lower case: `gpt2edge COMMAND` is a placeholder) where a shell command starts: at the line's
# start, after a prompt `$ `, a pipe, `&&`, `;` or `$(`
_COMMAND = re.compile(r"(?:^|[\s;|&(`])(?:\$ )?gpt2edge[ \t]+([a-z][a-z0-9-]*)\b")
_OPTION = re.compile(r"^--?[A-Za-z][\w-]*")
_SHELL_LANGS = {"", "bash", "sh", "shell", "console", "text", "zsh"}


@dataclass(frozen=True)
class Use:
    where: str  # file:line
    command: str
    options: tuple[str, ...]
    synopsis: bool  # a usage line: it shows optional parts as [--option ...]
    text: str = ""  # the command's own words, quoted strings blanked


def options_of(text: str) -> list[str]:
    """The option names a command line uses: `-x`, `--long`, `--long=value`, inside [...] and (...|...) too."""
    found = []
    for word in re.split(r"[\s\[\]()|,]+", drop_quoted(text)):
        m = _OPTION.match(word)
        if m and not re.match(r"^-\d", word):
            found.append(m.group(0))
    return found


def _cut_at_shell_end(text: str) -> str:
    """The command's own words: up to a pipe (` | `), `&&`, `;`, `&` or a redirection outside [...] / (...); a `|`
    inside them, or between words (`--format ort|genai`), separates alternatives of a synopsis."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth = max(0, depth - 1)
        elif depth == 0 and ch in ";&>" or (depth == 0 and ch == "|" and text[i + 1 : i + 2] in ("", " ", "\t")):
            return text[:i]
    return text


def uses_in_line(text: str, where: str, synopsis: bool) -> list[Use]:
    text = strip_comment(text)
    matches = list(_COMMAND.finditer(drop_quoted(text)))
    uses = []
    for m, nxt in zip(matches, [*matches[1:], None]):
        # drop_quoted keeps no offsets, so cut the quoted-free text; options are all we read from it
        bare = drop_quoted(text)
        segment = bare[m.end() : nxt.start() if nxt else len(bare)]
        own = _cut_at_shell_end(segment)
        uses.append(Use(where, m.group(1), tuple(options_of(own)), synopsis, own))
    return uses


def doc_uses() -> list[Use]:
    uses = []
    for path in doc_files():
        rel = path.relative_to(ROOT)
        for block in fenced_blocks(path):
            if block.lang not in _SHELL_LANGS:
                continue
            current: Use | None = None
            prev_raw = ""
            # a usage block: no language, placeholders (MODEL_DIR, OUT), optional parts in [--option ...]; all its
            # command lines are synopses (a block of example commands names real paths: out/gpt2)
            synopsis = (
                not block.lang
                and any("[-" in strip_comment(raw) for raw in block.lines)
                and any(re.search(r"gpt2edge [a-z-]+ .*\b[A-Z][A-Z_]{2,}\b", raw) for raw in block.lines)
            )
            for offset, raw in enumerate(block.lines, 1):
                where = f"{rel}:{block.line + offset}"
                line = strip_comment(raw)
                found = uses_in_line(line, where, synopsis)
                continued = current is not None and (raw[:1].isspace() or prev_raw.rstrip().endswith("\\"))
                if found:
                    uses.extend(found)
                    current = found[-1]
                elif continued and line.strip():
                    # a synopsis or a `\`-continued command goes on over indented lines
                    own = _cut_at_shell_end(drop_quoted(line))
                    more = Use(where, current.command, tuple(options_of(own)), current.synopsis, own)
                    uses.append(more)
                else:
                    current = None
                prev_raw = raw
        # code spans in the prose: `gpt2edge generate MODEL_DIR -i`
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
                if span.startswith("gpt2edge "):
                    uses.extend(uses_in_line(span, f"{rel}:{n}", synopsis=False))
    return uses


def cli_options(command: click.Command) -> dict[str, click.Parameter]:
    """Every spelling of every option of a command (both halves of --a/--b flags), and --help."""
    names = {o: p for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
    names.update({o: None for o in command.get_help_option_names(click.Context(command))})
    return names


DOC_USES = doc_uses()


def test_the_docs_have_command_lines():
    # the parser finds what is there: a parser that finds nothing would pass every check below
    commands = {u.command for u in DOC_USES}
    assert {"export", "generate", "quantize", "convert", "score", "serve", "bench", "trim-vocab"} <= commands
    assert sum(len(u.options) for u in DOC_USES) > 100
    assert {u.command for u in DOC_USES if u.synopsis} >= {"export", "generate", "quantize", "score", "serve"}


def test_every_documented_command_exists():
    unknown = [f"{u.where}: gpt2edge {u.command}" for u in DOC_USES if u.command not in main.commands]
    assert unknown == [], f"not a gpt2edge command (gpt2edge --help lists them): {unknown}"


def test_every_documented_option_is_a_parameter_of_its_command():
    wrong = [
        f"{u.where}: gpt2edge {u.command} {opt}"
        for u in DOC_USES
        if u.command in main.commands
        for opt in u.options
        if opt not in cli_options(main.commands[u.command])
    ]
    assert wrong == [], "options the command does not have (see gpt2edge COMMAND --help):\n" + "\n".join(wrong)


def test_every_command_has_a_synopsis():
    # a command without one would escape the check below
    assert sorted(set(main.commands) - {u.command for u in DOC_USES if u.synopsis}) == []


@pytest.mark.parametrize("name", sorted({u.command for u in DOC_USES if u.synopsis}))
def test_each_synopsis_lists_every_option_of_its_command(name):
    command = main.commands[name]
    shown = {opt for u in DOC_USES if u.synopsis and u.command == name for opt in u.options}
    allowed = ALLOWED_OMISSIONS.get(name, {})
    missing = [
        p.opts[-1]
        for p in command.params
        if isinstance(p, click.Option)
        and not p.hidden
        and not set(p.opts + p.secondary_opts) & shown
        and p.opts[-1] not in allowed
    ]
    where = sorted({u.where.split(":")[0] for u in DOC_USES if u.synopsis and u.command == name})
    assert missing == [], f"gpt2edge {name} has options its synopsis in {where} does not show: {missing}"


_ALTERNATIVES = re.compile(r"(--?[A-Za-z][\w-]*)[ =]([\w.-]+(?:\|[\w.-]+)+)(?![\w.|-])")
_SPAN = re.compile(r"(--?[A-Za-z][\w-]*)[ =](-?\d+)\.\.(-?\d+)(?![\w.])")


def listed_values(text: str) -> list[tuple[str, list[str] | tuple[int, int]]]:
    """What a synopsis lists as an option's values: `--head last|all|tail` (choices) or `--opset 18..23` (a span)."""
    found: list[tuple[str, list[str] | tuple[int, int]]] = []
    found += [(m.group(1), m.group(2).split("|")) for m in _ALTERNATIVES.finditer(text)]
    found += [(m.group(1), (int(m.group(2)), int(m.group(3)))) for m in _SPAN.finditer(text)]
    return found


def test_listed_values_are_the_commands_choices_and_ranges():
    # `--mode fp16|int8|int4` must be every choice click accepts, no more, no fewer; `--opset 18..23` its range
    wrong, checked = [], 0
    for u in DOC_USES:
        command = main.commands.get(u.command)
        for opt, listed in listed_values(u.text) if command else []:
            param = cli_options(command).get(opt)
            if param is None:
                continue  # an unknown option: test_every_documented_option_is_a_parameter_of_its_command
            kind = param.type
            if isinstance(kind, click.Choice):
                real = [str(c) for c in kind.choices]
                ok = (
                    sorted(listed) == sorted(real)
                    if isinstance(listed, list)
                    else (listed == (min(map(int, real)), max(map(int, real))))
                )
            elif isinstance(kind, click.IntRange) and isinstance(listed, tuple):
                real = f"{kind.min}..{kind.max}"
                ok = listed == (kind.min, kind.max)
            else:
                real, ok = kind.name, False
            checked += 1
            if not ok:
                wrong.append(f"{u.where}: gpt2edge {u.command} {opt} lists {listed}; the command takes {real}")
    assert checked >= 10, "the parser found no values to check"
    assert wrong == [], "\n".join(wrong)


_SHOWN_DEFAULT = re.compile(r"\[(--?[A-Za-z][\w-]*)[ =]([^\s\[\]|()]+)\]")


def shown_defaults(text: str) -> list[tuple[str, str]]:
    """`[--port 8000]` in a synopsis shows the default; `[--port N]` (a placeholder: upper case) does not."""
    return [
        (m.group(1), m.group(2))
        for m in _SHOWN_DEFAULT.finditer(text)
        if m.group(2) == m.group(2).lower() and ".." not in m.group(2)  # `16..256` is a range
    ]


def _same(shown: str, param: click.Parameter) -> bool:
    default = param.default
    if default is None:  # resolved at run time; the help says to what ("[default: 128; ...]")
        return f"default: {shown}" in (getattr(param, "help", None) or "")
    if isinstance(default, bool):
        return False
    if isinstance(default, int | float):
        try:
            return float(shown) == float(default)
        except ValueError:
            return False
    return shown == str(default)


def test_defaults_a_synopsis_shows_are_the_commands_defaults():
    wrong, checked = [], 0
    for u in DOC_USES:
        command = main.commands.get(u.command)
        for opt, shown in shown_defaults(u.text) if command and u.synopsis else []:
            param = cli_options(command).get(opt)
            if param is None:
                continue
            checked += 1
            if not _same(shown, param):
                wrong.append(f"{u.where}: gpt2edge {u.command} [{opt} {shown}]; its default is {param.default!r}")
    assert checked >= 10, "the parser found no defaults to check"
    assert wrong == [], "\n".join(wrong)


# ---- the parser itself -------------------------------------------------------------------------------------------


def test_the_parser_reads_command_lines_as_a_shell_would():
    line = 'gpt2edge generate out -p "say -n --not-an-option" -n 5 --json | jq .text  # --neither'
    (use,) = uses_in_line(line, "x", synopsis=False)
    assert (use.command, use.options) == ("generate", ("-p", "-n", "--json"))
    use = uses_in_line("gpt2edge export -m gpt2 out && gpt2edge quantize out -o q --mode=int4", "x", False)
    assert [(u.command, u.options) for u in use] == [("export", ("-m",)), ("quantize", ("-o", "--mode"))]
    line = "gpt2edge convert DIR -o OUT --format ort|genai [--force] (-p P | -f F) --atol 1e-4"
    (use,) = uses_in_line(line, "", True)
    assert use.options == ("-o", "--format", "--force", "-p", "-f", "--atol")
    assert uses_in_line("from gpt2edge.runtime import Generator", "x", False) == []
    assert listed_values(use.text) == [("--format", ["ort", "genai"])]
    assert listed_values(" --opset 18..23 [--head-bits 8|4] --atol 1e-4 (-p P | -f F)") == [
        ("--head-bits", ["8", "4"]),
        ("--opset", (18, 23)),
    ]


def test_a_drifted_doc_fails(tmp_path, monkeypatch):
    from tests.support import docs_markdown

    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    page.write_text(
        "```\ngpt2edge convert MODEL_DIR -o OUT [--format ort|genai]\n     [--forse]\n```\n\n"
        "```bash\ngpt2edge generat out -p hi\n```\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(docs_markdown, "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "doc_files", lambda: [page])
    uses = doc_uses()
    assert [(u.command, u.options, u.synopsis) for u in uses] == [
        ("convert", ("-o", "--format"), True),
        ("convert", ("--forse",), True),
        ("generat", ("-p",), False),
    ]
    assert "--forse" not in cli_options(main.commands["convert"])
    assert "generat" not in main.commands
    # and the synopsis misses --json and --force
    shown = {o for u in uses if u.synopsis for o in u.options}
    assert not {"--json", "--force"} & shown


def test_cli_options_follow_the_live_command():
    # read from the click objects: a new option or alias is known the moment it is declared
    @click.command()
    @click.option("-t", "--threads", "--n-threads")
    @click.option("--do-sample/--greedy")
    def cmd(threads, do_sample):
        pass

    assert set(cli_options(cmd)) == {"-t", "--threads", "--n-threads", "--do-sample", "--greedy", "--help"}
