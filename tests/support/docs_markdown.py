"""Reading the docs for the docs tests: which Markdown files there are, their links and anchors (from the HTML that
Python-Markdown renders, as MkDocs renders it), and the shell lines of their fenced code blocks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def doc_files() -> list[Path]:
    """README.md (which MkDocs never sees) and every page under docs/."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


class _LinksAndIds(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()
        self.pre = 0  # code blocks rendered as blocks

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href") is not None:
            self.hrefs.append(a["href"])
        if tag == "img" and a.get("src") is not None:
            self.hrefs.append(a["src"])
        self.pre += tag == "pre"


def render(text: str) -> _LinksAndIds:
    """A Markdown text as MkDocs renders it (its default extensions: toc's heading ids, tables, fenced code), read
    back: its link targets (code spans and code blocks hold none), the anchors it defines, its code blocks."""
    import markdown  # MkDocs' own Markdown (the dev extra); only the link checks need it

    parser = _LinksAndIds()
    parser.feed(markdown.markdown(text, extensions=["toc", "tables", "fenced_code"]))
    return parser


def links_and_ids(text: str) -> tuple[list[str], set[str]]:
    parsed = render(text)
    return parsed.hrefs, parsed.ids


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    lines: list[str]


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def fenced_blocks(path: Path) -> list[Block]:
    blocks, open_fence, start, lang, body = [], None, 0, "", []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if open_fence is None and m:
            open_fence, start, lang, body = m.group(2), i, m.group(3).lower(), []
        elif open_fence is not None and line.strip().startswith(open_fence) and not line.strip().strip(open_fence[0]):
            blocks.append(Block(path, start, lang, body))
            open_fence = None
        elif open_fence is not None:
            body.append(line)
    assert open_fence is None, f"{path}: the fence opened at line {start} is never closed"
    return blocks


def strip_comment(line: str) -> str:
    """A shell line without its `# comment` (a # that starts a word, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def drop_quoted(line: str) -> str:
    """The line with quoted strings blanked, so a prompt such as "-n" never reads as an option."""
    return re.sub(r"\"(?:[^\"\\]|\\.)*\"|'[^']*'", " QUOTED ", line)
