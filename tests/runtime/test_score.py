"""`gpt2edge score`: sliding-window log-likelihood and perplexity, equal to transformers on the same windows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.score import Scorer, windows
from gpt2edge.sample_text import SAMPLE_TEXT

LONG_TEXT = SAMPLE_TEXT * 3  # several hundred tokens: longer than the tiny model's 128 positions


def hf_window_logprobs(hf_model, ids: list[int], max_length: int, stride: int) -> list[float]:
    """The perplexity guide's loop with transformers, kept per token: log p(token t) for t = 1 .. n-1."""
    out: dict[int, float] = {}
    prev_end = 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        x = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(x).logits[0].double(), -1)  # (T, V)
        for t in range(max(end - trg_len, begin + 1), end):
            out[t] = float(lp[t - begin - 1, ids[t]])
        prev_end = end
        if end == len(ids):
            break
    return [out.get(t) for t in range(len(ids))]


@pytest.mark.parametrize("n,max_length,stride", [(10, 4, 1), (10, 4, 4), (300, 128, 64), (129, 128, 128), (5, 128, 64)])
def test_windows_score_every_token_but_the_first_once(n, max_length, stride):
    plan = windows(n, max_length, stride)
    scored = [t for w in plan for t in range(w.first_target, w.end)]
    assert len(scored) == len(set(scored))  # no token twice
    # unscored: token 0, and a window's first token when the windows do not overlap (no context for it)
    window_starts = [w.begin for w in plan[1:]] if stride == max_length else []
    assert sorted(set(range(n)) - set(scored)) == [0, *window_starts]
    assert all(w.end - w.begin <= max_length and w.begin < w.first_target for w in plan)


@pytest.mark.parametrize("fixture", ["tiny_export_all", "tiny_export", "tiny_export_shared"])
@pytest.mark.parametrize("max_length,stride", [(128, 64), (64, 64), (100, 30)])
def test_score_equals_transformers(request, hf_model, fixture, max_length, stride):
    scorer = Scorer(ModelFolder.open(request.getfixturevalue(fixture)))
    r = scorer.score(LONG_TEXT, max_length=max_length, stride=stride)
    assert r.tokens > 128 and r.windows > 1
    assert r.method == ("head-all" if fixture == "tiny_export_all" else "token-by-token")
    ref = hf_window_logprobs(hf_model, r.token_ids, max_length, stride)
    assert [x is None for x in r.token_logprobs] == [x is None for x in ref]
    got = np.array([x for x in r.token_logprobs if x is not None])
    ref = [x for x in ref if x is not None]
    diff = np.abs(got - np.array(ref)).max()
    assert diff <= 1e-4, f"per-token log-prob maxdiff {diff:.2e} (fp32 threshold 1e-4)"
    ref_ppl = float(np.exp(-np.mean(ref)))
    assert abs(r.perplexity - ref_ppl) / ref_ppl <= 1e-4
    assert r.token_logprobs[0] is None and r.scored_tokens == len(ref)


def test_head_all_and_token_by_token_agree_on_one_folder(tiny_export_all):
    scorer = Scorer(ModelFolder.open(tiny_export_all))
    a = scorer.score(LONG_TEXT, stride=40, method="head-all")
    b = scorer.score(LONG_TEXT, stride=40, method="token-by-token")
    assert np.abs(np.array(a.token_logprobs[1:]) - np.array(b.token_logprobs[1:])).max() <= 1e-4


@pytest.mark.parametrize(
    "kwargs,text,match",
    [
        ({}, "", "at least 2"),
        ({"max_length": 129}, LONG_TEXT, "max_length must be in 2..128"),
        ({"max_length": 64, "stride": 65}, LONG_TEXT, "would skip tokens"),
        ({"stride": 0}, LONG_TEXT, "stride must be"),
        ({"method": "head-all"}, LONG_TEXT, "--head all"),
        ({"method": "fast"}, LONG_TEXT, "Unknown scoring method"),
    ],
)
def test_bad_requests_are_clear_errors(tiny_export, kwargs, text, match):
    with pytest.raises(GenerationError, match=match):
        Scorer(ModelFolder.open(tiny_export)).score(text, **kwargs)


def test_tokenizer_larger_than_the_model_is_refused(tiny_export, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    bad = tmp_path / "bad"
    shutil.copytree(tiny_export, bad)
    big = ByteLevelBPETokenizer()
    big.train_from_iterator([LONG_TEXT * 4], vocab_size=2000, min_frequency=1, special_tokens=["<|endoftext|>"])
    big.save(str(bad / "tokenizer.json"))
    # refused when the folder's tokenizer is loaded, from its size, before any text is tokenized
    with pytest.raises(ModelFolderError, match="but the model's embedding only 400 rows"):
        Scorer(ModelFolder.open(bad, verify=False))


def run_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpt2edge.cli", *args], input=stdin, capture_output=True, timeout=120
    )


def test_score_cli_json_from_stdin_and_errors(tiny_export_all, tmp_path):
    p = run_cli("score", str(tiny_export_all), "-", "--json", "--stride", "64", stdin=LONG_TEXT.encode())
    assert p.returncode == 0, p.stderr.decode()
    obj = json.loads(p.stdout)  # pure JSON on stdout
    assert obj["method"] == "head-all" and obj["stride"] == 64 and len(obj["token_logprobs"]) == obj["tokens"]
    assert obj["perplexity"] == pytest.approx(np.exp(-np.mean(obj["token_logprobs"][1:])), rel=1e-9)  # overlapping

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    for f, msg in [(empty, b"at least 2"), (latin1, b"not UTF-8")]:
        p = run_cli("score", str(tiny_export_all), str(f))
        assert p.returncode == 1 and p.stderr.startswith(b"error: ") and msg in p.stderr
        assert b"Traceback" not in p.stderr
