"""`gpt2edge score` on a long text: the windows done show on stderr (a line per tenth off a terminal; --json
keeps stdout one JSON object), and the text is tokenized piece by piece, cut only where GPT-2's pre-tokenizer
always cuts, so the ids are those of one encode() while the tokenizer never holds more than a piece."""

from __future__ import annotations

import base64
import json
import random

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.runtime.model.tokenizer import TextTokenizer
from gpt2edge.sample_text import SAMPLE_TEXT

# every kind of boundary: prose, base64 lines, runs of spaces and tabs, digits against letters, non-ASCII,
# non-breaking spaces, special tokens, contractions
PARTS = [
    SAMPLE_TEXT[:3000],
    base64.encodebytes(random.Random(0).randbytes(3000)).decode(),
    "  double  spaces\t\ttabs \n\n lines 123abc abc123 x1y2z3 ",
    "h\u00e9llo w\u00f6rld \u65e5\u672c\u8a9e \U0001f389\U0001f389 ",
    "\u00a0nbsp\u2003em \u3000x ",
    "<|endoftext|>a<|endoftext|> 9<|endoftext|>",
    "'s 're 'll don't 3.14 ... x's1",
]


@pytest.mark.parametrize("piece_chars", [1, 3, 64, 4096])
def test_pieces_give_the_ids_of_one_encode(tiny_export, piece_chars):
    tok = TextTokenizer(tiny_export / "tokenizer.json")
    rng = random.Random(piece_chars)
    text = "".join(rng.choice(PARTS) for _ in range(12))
    assert list(tok.encode_long(text, piece_chars)) == tok.encode(text)


def test_the_tokenizer_sees_one_piece_at_a_time(tiny_export):
    tok = TextTokenizer(tiny_export / "tokenizer.json")
    text = base64.encodebytes(random.Random(1).randbytes(60_000)).decode()  # 80 kB, one line per 76 characters
    seen = []
    inner = tok._tok

    class Spy:
        def __getattr__(self, name):
            return getattr(inner, name)

        def encode(self, piece, **kw):
            seen.append(len(piece))
            return inner.encode(piece, **kw)

    assert tok._cuttable  # decided on the real tokenizer (GPT-2's byte-level one)
    tok._tok = Spy()
    ids = tok.encode_long(text, 1000)
    tok._tok = inner
    assert list(ids) == tok.encode(text)
    # each piece ends at the first cut past 1000 characters: a base64 line has one every few characters
    assert len(seen) > 50 and max(seen) < 1100


def test_score_shows_windows_done_on_stderr_and_json_stays_pure(tiny_export_all, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(SAMPLE_TEXT * 2)
    r = CliRunner().invoke(main, ["score", str(tiny_export_all), str(path), "--max-length", "32", "--stride", "32",
                                  "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)  # stdout: the one JSON object, nothing else
    assert result["windows"] >= 20
    lines = r.stderr.strip().splitlines()
    # off a terminal: a line per tenth of the windows, the last one when all are done
    assert 9 <= len(lines) <= 11, lines
    assert all(line.startswith("score: ") and "windows done" in line for line in lines), lines
    assert lines[-1].startswith(f"score: {result['windows']}/{result['windows']} windows done")
    # one window: nothing to follow, nothing printed
    short = tmp_path / "short.txt"
    short.write_text("The river rose and the city slept.")
    r = CliRunner().invoke(main, ["score", str(tiny_export_all), str(short), "--json"])
    assert r.exit_code == 0 and r.stderr == "", r.stderr
