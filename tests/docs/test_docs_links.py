"""Every relative link and anchor in README.md and docs/*.md resolves (MkDocs never sees README.md, so `mkdocs build
--strict` in scripts/test.sh cannot check its links into docs/), and the MkDocs config fails the build on a broken
link or anchor."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.support.docs_markdown import DOCS, ROOT, doc_files, fenced_blocks, links_and_ids, render

pytest.importorskip("markdown", reason="the docs checks need mkdocs (pip install '.[dev]')")


def _ids(path: Path, cache: dict[Path, set[str]]) -> set[str]:
    if path not in cache:
        cache[path] = links_and_ids(path.read_text(encoding="utf-8"))[1]
    return cache[path]


def broken_links(files: list[Path], docs_dir: Path = DOCS) -> list[str]:
    """'file: href (why)' for each relative link that does not resolve to a file, or to an anchor in it."""
    bad, cache = [], {}
    for path in files:
        hrefs, _ = links_and_ids(path.read_text(encoding="utf-8"))
        for href in hrefs:
            url = urlsplit(href)
            if url.scheme or url.netloc:  # http(s), mailto: no network here
                continue
            where = f"{path.relative_to(ROOT)}: {href}"
            if url.path.startswith("/"):
                bad.append(f"{where} (absolute path: breaks on GitHub and in the site; make it relative)")
                continue
            target = (path.parent / unquote(url.path)).resolve() if url.path else path
            if not target.exists():
                bad.append(f"{where} (no such file)")
                continue
            if path.is_relative_to(docs_dir) and not target.is_relative_to(docs_dir):
                bad.append(f"{where} (outside docs/: not in the site; name it as code, or link to GitHub)")
                continue
            if url.fragment and target.suffix == ".md" and unquote(url.fragment) not in _ids(target, cache):
                bad.append(f"{where} (no heading with the anchor #{url.fragment} in {target.name})")
    return bad


def test_every_relative_link_and_anchor_resolves():
    assert broken_links(doc_files()) == []


def test_every_code_block_renders_as_a_code_block():
    # MkDocs' Markdown does not nest a fence in a list item (GitHub does): it renders as inline code, the ``` and
    # the language showing as text. Keep fenced blocks at the top level of a page.
    wrong = []
    for page in sorted(DOCS.rglob("*.md")):
        fences, pre = len(fenced_blocks(page)), render(page.read_text(encoding="utf-8")).pre
        if pre != fences:
            nested = [b.line for b in fenced_blocks(page) if b.lines and b.lines[0][:1].isspace()]
            wrong.append(f"{page.relative_to(ROOT)}: {fences} fenced blocks, {pre} rendered (nested: lines {nested})")
    assert wrong == []


def _linked_from(path: Path) -> set[Path]:
    hrefs, _ = links_and_ids(path.read_text(encoding="utf-8"))
    return {(path.parent / unquote(urlsplit(h).path)).resolve() for h in hrefs if not urlsplit(h).scheme}


def test_every_docs_page_is_one_click_from_the_readme_or_two_through_the_index():
    # the landing page is how a newcomer finds the pages: README.md -> docs/index.md -> every page
    from_readme = _linked_from(ROOT / "README.md")
    assert (DOCS / "index.md").resolve() in from_readme
    reachable = from_readme | _linked_from(DOCS / "index.md")
    pages = {p.resolve() for p in DOCS.glob("*.md") if p.name != "index.md"}
    assert sorted(p.name for p in pages - reachable) == []


def test_the_checker_finds_broken_links(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text(
        "# A\n\n## Known limits\n\n[ok](#known-limits) [ok2](b.md#part-two) `[no](nowhere.md)`\n"
    )
    (docs / "b.md").write_text(
        "# B\n\n## Part two\n\n[gone](a.md#limits) [missing](c.md) [out](../x.md) [abs](/a.md)\n\n"
        "```\n[in a block](nowhere.md)\n```\n"
    )
    (tmp_path / "x.md").write_text("# x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = broken_links([docs / "a.md", docs / "b.md"], docs_dir=docs)
    assert [b.split(" (")[0] for b in bad] == [
        "docs/b.md: a.md#limits",
        "docs/b.md: c.md",
        "docs/b.md: ../x.md",
        "docs/b.md: /a.md",
    ]


def test_mkdocs_strict_fails_on_a_broken_anchor(tmp_path):
    # the config (validation: ... warn) plus --strict is what makes scripts/test.sh fail on these
    pytest.importorskip("mkdocs")
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "index.md"

    # the command scripts/test.sh (CI) runs, as it is written there (--quiet there would hide the warnings that
    # --strict turns into a failure, and this test would see it)
    script = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    (line,) = [ln for ln in script.splitlines() if ln.startswith("python -m mkdocs build")]
    args = shlex.split(line, comments=True)
    assert args[:4] == ["python", "-m", "mkdocs", "build"] and "--strict" in args, line
    args = [sys.executable, *[str(tmp_path / "site") if a == "$site" else a for a in args[1:]]]

    def build() -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True)

    ok = build()
    assert ok.returncode == 0, ok.stderr
    original = page.read_text(encoding="utf-8")
    for broken in ["[x](export.md#no-such-heading)", "[x](#nowhere)", "[x](no-such-page.md)", "[x](/export.md)"]:
        page.write_text(original + f"\n{broken}\n", encoding="utf-8")
        r = build()
        assert r.returncode != 0, f"mkdocs build --strict passed with {broken}"
    page.write_text(original, encoding="utf-8")
    (tmp_path / "docs" / "orphan.md").write_text("# A page the nav leaves out\n", encoding="utf-8")
    assert build().returncode != 0, "mkdocs build --strict passed with a page left out of the nav"
