"""Which text a quality report scores, and saying so.

A report on the built-in English sample says little about a model trained on code or on another language.
So a --text given to export, quantize or trim-vocab is recorded in the new folder (quality_text.txt, listed
and checksummed in its manifest like every file, and copied into the variants made from it), and later
reports on that folder or its variants score it by default. Without either, the built-in sample is scored
and a note says that a text from the model's own domain gives truer figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpt2edge.errors import Gpt2EdgeError
from gpt2edge.manifest import load_manifest, resolve_inside
from gpt2edge.prompt_input import decode_utf8, read_text_file

RECORDED_TEXT = "quality_text.txt"
BUILT_IN = "the built-in English sample"
DOMAIN_NOTE = (
    "note: the quality report scores the built-in English sample; a text from the model's own domain gives truer "
    "figures: pass --text FILE (quantize and trim-vocab record it in the new folder for later reports)."
)


@dataclass(frozen=True)
class ReportText:
    """text None: the built-in sample. source: what was scored, in words; note: a line for the user, or None."""

    text: str | None
    source: str
    note: str | None = None


def recorded_text(folder: Path) -> str | None:
    """The text recorded in an export folder, or None (no folder, no manifest, nothing recorded)."""
    try:
        info = load_manifest(Path(folder))
        if RECORDED_TEXT not in info.files:
            return None
        return decode_utf8(resolve_inside(Path(folder), RECORDED_TEXT).read_bytes(), f"{folder}/{RECORDED_TEXT}")
    except (Gpt2EdgeError, OSError):
        return None


def choose_report_text(text_file: Path | None, folders: list[Path]) -> ReportText:
    """--text FILE when given, else the first of `folders` that records a text, else the built-in sample."""
    if text_file is not None:
        return ReportText(read_text_file(text_file), f"--text {text_file}")
    for folder in folders:
        text = recorded_text(folder)
        if text is not None:
            return ReportText(text, f"{Path(folder) / RECORDED_TEXT} (recorded when the folder was made)")
    return ReportText(None, BUILT_IN, DOMAIN_NOTE)


def record_text(folder: Path, text: str) -> None:
    """Write the report's text into a folder being made (before its manifest is written, which lists it)."""
    (Path(folder) / RECORDED_TEXT).write_text(text, encoding="utf-8", newline="")
