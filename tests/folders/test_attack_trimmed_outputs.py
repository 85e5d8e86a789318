"""A vocabulary-trimmed folder (gpt2edge trim-vocab) through the new generation and deploy features: the
tokens its head dropped have probability 0, which must not leak out as -inf into JSON, a perplexity, or a
converted folder another runtime cannot run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from gpt2edge.cli import main
from gpt2edge.convert.handler import convert_folder
from gpt2edge.errors import ConvertError, GenerationError
from gpt2edge.runtime import Generator, ModelFolder
from gpt2edge.runtime.decoding.logprobs import top_ids
from gpt2edge.runtime.score import Scorer
from gpt2edge.trim.handler import trim_vocab

EOS = 0  # the tiny tokenizer's <|endoftext|>
PROMPT = "The river rose and"


@pytest.fixture(scope="module")
def trimmed(tiny_export, tmp_path_factory):
    """EOS, the 256 byte tokens and a few more kept: most of the 400 tokens are dropped."""
    root = tmp_path_factory.mktemp("attack-trim")
    keep = np.unique([EOS, *np.random.default_rng(0).choice(np.arange(1, 400), 20, replace=False)])
    ids = root / "keep.json"
    ids.write_text(json.dumps([int(i) for i in keep]))
    trim_vocab(tiny_export, root / "trimmed", keep_ids=ids, report=False)
    return root / "trimmed"


def test_top_ids_never_lists_impossible_tokens():
    row = np.full(10, -np.inf, dtype=np.float32)
    row[[2, 7, 5]] = [-1.0, -0.5, -3.0]
    assert top_ids(row, 10).tolist() == [7, 2, 5]
    assert top_ids(row, 2).tolist() == [7, 2]


def test_logprobs_of_a_trimmed_folder_are_finite_and_json_is_strict(trimmed):
    g = Generator(trimmed)
    kept = ModelFolder.open(trimmed).kept_ids()
    r = g.generate(PROMPT, max_new_tokens=4, logprobs=400, ignore_eos=True)
    for rec in r.logprobs:
        assert math.isfinite(rec.logprob)
        assert len(rec.top_logprobs) == len(kept)  # every possible token, none of the dropped ones
        assert all(math.isfinite(t.logprob) and t.token_id in kept for t in rec.top_logprobs)
    out = CliRunner().invoke(
        main, ["generate", str(trimmed), "-p", PROMPT, "-n", "3", "--json", "--logprobs", "400"], catch_exceptions=False
    )
    assert out.exit_code == 0, out.output
    json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_score_refuses_text_a_trimmed_folder_cannot_produce(trimmed):
    scorer = Scorer(ModelFolder.open(trimmed))
    kept = set(ModelFolder.open(trimmed).kept_ids().tolist())
    dropped = next(i for i in range(1, 400) if i not in kept)
    text = scorer.tokenizer.decode([int(i) for i in sorted(kept)[1:4]] + [dropped])
    with pytest.raises(GenerationError, match="trim"):
        scorer.score(text)
    out = CliRunner().invoke(main, ["score", str(trimmed), "--json"], input=text)
    assert out.exit_code == 1 and out.output.startswith("error:") and "Traceback" not in out.output
    # text made only of kept tokens still scores, with a finite perplexity
    ok = scorer.score_ids(sorted(kept)[1:6])
    assert math.isfinite(ok.perplexity)


def test_genai_convert_of_a_trimmed_folder_is_a_clear_error(trimmed, tmp_path):
    with pytest.raises(ConvertError, match="trim"):
        convert_folder(trimmed, tmp_path / "genai", "genai")
    assert not (tmp_path / "genai").exists()
    out = CliRunner().invoke(main, ["convert", str(trimmed), "-o", str(tmp_path / "g2"), "--format", "genai"])
    assert out.exit_code == 1 and out.output.startswith("error:")
