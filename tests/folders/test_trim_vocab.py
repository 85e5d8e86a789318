"""Vocabulary-trimmed heads: the graph's log-probs are the full model's restricted to the kept ids and
renormalised (fp32 against PyTorch, quantized ones against their parent), the runtime maps them back to full
ids (generation, streaming, results unchanged), the keep-set rules, the manifest record, and bad input."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tokenizers import ByteLevelBPETokenizer, Tokenizer

from gpt2edge.cli import main
from gpt2edge.errors import ModelFolderError, TrimError
from gpt2edge.manifest import Manifest, load_manifest, write_manifest
from gpt2edge.quality import compare_folders, stream_logprobs
from gpt2edge.quantize import make_recipe, quantize_model
from gpt2edge.runtime import Generator, ModelFolder
from gpt2edge.runtime.model.lm import OrtLM
from gpt2edge.sample_text import SAMPLE_TEXT
from gpt2edge.trim.handler import trim_vocab
from gpt2edge.trim.keep import byte_token_ids
from tests.support import cli as run_cli

EOS = 0  # the tiny tokenizer's <|endoftext|>
V = 400  # the tiny model's vocabulary
PROMPT = "The river rose and"


def ids_file(path: Path, ids) -> Path:
    path.write_text(json.dumps([int(i) for i in ids]))
    return path


def random_keep(seed: int, n: int = 60) -> np.ndarray:
    """EOS plus n random ids: with the 256 byte tokens added, a real subset of the 400."""
    rng = np.random.default_rng(seed)
    return np.unique([EOS, *rng.choice(np.arange(1, V), n, replace=False)])


def trim(src: Path, out: Path, keep, **kw) -> Path:
    trim_vocab(src, out, keep_ids=ids_file(out.parent / f"{out.name}.json", keep), report=False, **kw)
    return out


def restricted(lp: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """(..., V) full log-probs -> (..., K) log-probs over the kept ids, renormalised there."""
    x = lp[..., kept].astype(np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


@pytest.fixture(scope="module")
def parents(tiny_export, tmp_path_factory):
    root = tmp_path_factory.mktemp("trim-parents")
    out = {"fp32": tiny_export}
    for mode in ("fp16", "int8", "int4"):
        quantize_model(tiny_export, root / mode, make_recipe(mode), report=False)
        out[mode] = root / mode
    return out


@pytest.fixture(scope="module")
def trimmed_fp32(tiny_export, tmp_path_factory):
    return trim(tiny_export, tmp_path_factory.mktemp("trim") / "fp32", random_keep(0))


def test_fp32_logprobs_equal_torch_restricted_and_renormalised(trimmed_fp32, hf_model):
    folder = ModelFolder.open(trimmed_fp32)
    kept = folder.kept_ids()
    byte_ids = byte_token_ids(Tokenizer.from_file(str(folder.tokenizer_path)))
    assert kept.tolist() == np.union1d(byte_ids, random_keep(0)).tolist()  # the list + every single byte
    lm = OrtLM(folder)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, V, (2, 12))  # a batch of 2, every position checked after a 4-token prefill
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor(ids)).logits.double(), -1).numpy()  # (2, 12, V)
    lm.start(2, 12)
    mask = np.ones((2, 12), dtype=np.int64)
    pos = np.arange(12)[None].repeat(2, 0)
    out = [lm.forward(ids[:, :4], mask[:, :4], pos[:, :4]).copy()]
    for t in range(4, 12):
        out.append(lm.forward(ids[:, t : t + 1], mask[:, : t + 1], pos[:, t : t + 1]).copy())
    for step, lp in enumerate(out):  # (2, V) full-vocabulary rows
        t = 3 + step
        assert lp.shape == (2, V)
        assert np.all(np.isneginf(np.delete(lp, kept, axis=1)))  # dropped ids: probability 0
        assert np.abs(lp[:, kept] - restricted(ref[:, t], kept)).max() < 1e-5, t


def test_greedy_equals_full_model_when_its_argmax_is_kept(tiny_export, tmp_path):
    full = Generator(tiny_export).generate(PROMPT, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    # keep the full model's greedy tokens (their argmax) and a few others; drop the rest
    keep = np.union1d(full.token_ids, random_keep(2, 20))
    out = trim(tiny_export, tmp_path / "t", keep)
    r = Generator(out).generate(PROMPT, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert r.token_ids == full.token_ids and r.text == full.text
    assert r.prompt_token_ids == full.prompt_token_ids  # the input embedding is whole: prompts encode unchanged
    # drop the full model's first greedy choice that is not a (always kept) single-byte token: the trimmed
    # model follows it up to there, then must pick another, kept, token
    byte_ids = byte_token_ids(Tokenizer.from_file(str(tiny_export / "tokenizer.json")))
    i = next(i for i, t in enumerate(full.token_ids) if t not in byte_ids)
    without = trim(tiny_export, tmp_path / "t2", np.setdiff1d(keep, [full.token_ids[i]]))
    r2 = Generator(without).generate(PROMPT, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert r2.token_ids[:i] == full.token_ids[:i] and r2.token_ids[i] != full.token_ids[i]
    assert set(r2.token_ids) <= set(ModelFolder.open(without).kept_ids().tolist())


def test_text_and_streaming_use_full_ids(trimmed_fp32):
    gen = Generator(trimmed_fp32)
    kept = set(gen.lm.kept_ids.tolist())
    kw = dict(max_new_tokens=30, temperature=0.9, top_k=0, seed=5, ignore_eos=True)
    result: list = []
    pieces = list(gen.stream(PROMPT, result=result, **kw))
    r = gen.generate(PROMPT, **kw)
    assert "".join(pieces) == r.text == result[0].text == gen.tokenizer.decode(r.token_ids)
    assert set(r.token_ids) <= kept and max(r.token_ids) >= len(kept)  # full ids, not column numbers
    batch = gen.generate([PROMPT, "The city"], max_new_tokens=8, do_sample=False, ignore_eos=True)
    assert all(set(b.token_ids) <= kept for b in batch)


@pytest.mark.parametrize("mode,tol", [("fp16", 2e-2), ("int8", 1e-4), ("int4", 1e-4)])
def test_quantized_trim_matches_parent_restricted(parents, tmp_path, mode, tol):
    keep = random_keep(3)
    out = trim(parents[mode], tmp_path / mode, keep)
    tokens = Generator(parents[mode]).tokenizer.encode("The river rose and the city slept under the bridge")
    ref = stream_logprobs(OrtLM(ModelFolder.open(parents[mode])), tokens)
    lm = OrtLM(ModelFolder.open(out))
    got = stream_logprobs(lm, tokens)
    assert np.abs(got[:, lm.kept_ids] - restricted(ref, lm.kept_ids)).max() < tol
    m = dict(load_manifest(out).raw)
    assert m["graph"]["precision"] == mode and m["trim"]["parent"]["precision"] == mode
    assert m["trim"]["decode_weight_bytes_after"] < m["trim"]["decode_weight_bytes_before"]
    r = Generator(out).generate(PROMPT, max_new_tokens=8, ignore_eos=True, seed=0, temperature=0.8)
    assert len(r.token_ids) == 8 and set(r.token_ids) <= set(lm.kept_ids.tolist())


def test_shared_cache_export_trims(tiny_export_shared, tmp_path):
    full = Generator(tiny_export_shared).generate(PROMPT, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    out = trim(tiny_export_shared, tmp_path / "s", np.union1d(full.token_ids, [EOS]))
    r = Generator(out).generate(PROMPT, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert r.token_ids == full.token_ids


def test_keep_from_corpus_file_folder_and_top(tiny_export, tmp_path):
    tok = Generator(tiny_export).tokenizer
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("the the the river rose")
    (corpus / "sub" / "b.py").write_text("def city(): return 1\n")
    (corpus / "blob.bin").write_bytes(b"\xff\xfe\x00binary")  # not UTF-8: skipped
    m = trim_vocab(tiny_export, tmp_path / "all", keep_from=[corpus], report=False)
    seen = set(tok.encode("the the the river rose")) | set(tok.encode("def city(): return 1\n"))
    byte_ids = set(byte_token_ids(Tokenizer.from_file(str(tiny_export / "tokenizer.json"))))
    assert len(byte_ids) == 256
    kept = set(np.load(tmp_path / "all" / "kept_ids.npy").tolist())
    assert kept == seen | byte_ids | {EOS}
    assert m["trim"]["corpus_files"] == 2 and m["trim"]["corpus_files_skipped"] == 1
    # --top 1: the most frequent corpus token only (plus the always-kept ids)
    trim_vocab(tiny_export, tmp_path / "top", keep_from=[corpus / "a.txt"], top=1, report=False)
    the = max(set(tok.encode("the the the river rose")), key=tok.encode("the the the river rose").count)
    non_byte = set(np.load(tmp_path / "top" / "kept_ids.npy").tolist()) - byte_ids - {EOS}
    assert non_byte <= {the}


def test_manifest_lists_and_verifies_the_kept_ids(trimmed_fp32, tmp_path):
    m = dict(load_manifest(trimmed_fp32).raw)
    assert m["vocab"] == {"kept_ids_file": "kept_ids.npy", "kept": m["vocab"]["kept"], "full": V}
    assert "kept_ids.npy" in m["files"] and m["graph"]["outputs"][0]["shape"] == ["batch", m["vocab"]["kept"]]
    assert "kept_ids.npy" in ModelFolder.open(trimmed_fp32).info.loaded_files()
    bad = tmp_path / "bad"
    shutil.copytree(trimmed_fp32, bad)
    ids = np.load(bad / "kept_ids.npy")
    np.save(bad / "kept_ids.npy", ids[::-1].copy())  # same size, wrong content: the checksum catches it
    with pytest.raises(ModelFolderError, match="does not match its manifest checksum"):
        ModelFolder.open(bad)
    with pytest.raises(ModelFolderError, match="ascending list"):
        OrtLM(ModelFolder.open(bad, verify=False))
    # a manifest whose kept count disagrees with the graph is refused before anything runs
    np.save(bad / "kept_ids.npy", ids[:-1])
    data = json.loads((bad / "manifest.json").read_text())
    data["vocab"]["kept"] = len(ids) - 1
    write_manifest(bad, data)
    with pytest.raises(ModelFolderError, match="the graph scores"):
        OrtLM(ModelFolder.open(bad))
    data["files"].pop("kept_ids.npy")
    (bad / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelFolderError, match="kept_ids.npy is loaded but not listed"):
        ModelFolder.open(bad, verify=False)


@pytest.mark.parametrize(
    "vocab,phrase",
    [
        ({"kept_ids_file": "../kept_ids.npy", "kept": 258, "full": V}, "leaves the folder"),
        ({"kept_ids_file": "kept_ids.npy", "kept": 258, "full": V - 1}, "but the model has 400"),
        ({"kept_ids_file": "kept_ids.npy", "kept": V + 1, "full": V}, "keeps 401 of 400"),
        ({"kept_ids_file": "kept_ids.npy", "kept": True, "full": V}, "vocab.kept must be a positive integer"),
        ("kept_ids.npy", "'vocab' must describe"),
    ],
)
def test_manifest_vocab_record_is_validated(trimmed_fp32, vocab, phrase):
    data = dict(load_manifest(trimmed_fp32).raw)
    data["vocab"] = vocab
    with pytest.raises(ModelFolderError, match=phrase):
        Manifest.from_json(data)


def test_quality_report_compares_on_kept_ids(tiny_export, trimmed_fp32):
    rep = compare_folders(tiny_export, trimmed_fp32)
    assert rep["mean_kl"] < 1e-9 and rep["max_abs_logprob_diff"] < 1e-5  # the graph is exact on the kept ids
    # trim_kl is KL(trimmed || full) of the ideal trimmed distribution: check it from its definition
    lm = OrtLM(ModelFolder.open(tiny_export))
    tokens = Generator(tiny_export).tokenizer.encode(SAMPLE_TEXT)
    full = stream_logprobs(lm, tokens[: rep["tokens"]]).astype(np.float64)
    kept = ModelFolder.open(trimmed_fp32).kept_ids()
    p_trim = restricted(full, kept)
    kl = (np.exp(p_trim) * (p_trim - full[:, kept])).sum(-1).mean()
    assert rep["trim_kl"] == pytest.approx(kl, rel=1e-4) and rep["trim_kl"] > 0.01
    assert 0 < rep["coverage"] < 1 and rep["uncovered_tokens"] > 0
    cli = CliRunner().invoke(main, ["parity", str(tiny_export), str(trimmed_fp32), "--max-kl", "1e-9", "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["trim_kl"] == pytest.approx(rep["trim_kl"])


def test_trimmed_folder_quantizes(trimmed_fp32, tmp_path):
    m = quantize_model(trimmed_fp32, tmp_path / "q", make_recipe("int8"), report=True)
    assert m["vocab"] == load_manifest(trimmed_fp32).raw["vocab"] and m["quality"]["mean_kl"] < 5e-3
    r = Generator(tmp_path / "q").generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert set(r.token_ids) <= set(np.load(trimmed_fp32 / "kept_ids.npy").tolist())


cli = functools.partial(run_cli, "trim-vocab")  # the shared in-process runner, on trim-vocab


def refused(result, phrase: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], result.output


def test_bad_input_is_one_clear_line(tiny_export, tiny_export_all, trimmed_fp32, tmp_path):
    out = tmp_path / "out"
    keep = [EOS, 300, 301]
    refused(cli(tiny_export, "-o", out, "--keep-ids", ids_file(tmp_path / "u.json", [*keep, 400, -1])), "unknown")
    refused(cli(tiny_export, "-o", out, "--keep-ids", ids_file(tmp_path / "e.json", [300, 301])), "end-of-text")
    (tmp_path / "x.txt").write_text("0 12 twelve")
    refused(cli(tiny_export, "-o", out, "--keep-ids", tmp_path / "x.txt"), "'twelve' is not a token id")
    (tmp_path / "empty.txt").write_text("")
    refused(cli(tiny_export, "-o", out, "--keep-ids", tmp_path / "empty.txt"), "is empty")
    refused(cli(tiny_export, "-o", out, "--keep-ids", tmp_path / "nope.json"), "Cannot read the keep-list")
    good = ids_file(tmp_path / "k.json", keep)
    refused(cli(tiny_export, "-o", out, "--keep-ids", good, "--keep-from", good), "exactly one")
    refused(cli(tiny_export, "-o", out), "exactly one")
    refused(cli(tiny_export, "-o", out, "--keep-ids", good, "--top", "3"), "--keep-from only")
    refused(cli(tiny_export, "-o", out, "--keep-from", tmp_path / "missing"), "does not exist")
    refused(cli(tiny_export, "-o", out, "--keep-ids", ids_file(tmp_path / "a.json", range(V))), "nothing would be")
    (tmp_path / "plain").mkdir()
    refused(cli(tmp_path / "plain", "-o", out, "--keep-ids", good), "not a gpt2edge export")
    refused(cli(trimmed_fp32, "-o", out, "--keep-ids", good), "already vocabulary-trimmed")
    refused(cli(tiny_export_all, "-o", out, "--keep-ids", good), "--head all")
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused(cli(tiny_export, "-o", out, "--keep-ids", good), "already exists; pass --force")
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(TrimError, match="--top must be >= 1"):
        trim_vocab(tiny_export, tmp_path / "o2", keep_from=[good], top=0)


def test_cli_writes_folder_and_json(tiny_export, tmp_path):
    ok = cli(tiny_export, "-o", tmp_path / "o", "--keep-ids", ids_file(tmp_path / "k.json", [EOS, 300]), "--json")
    assert ok.exit_code == 0, ok.output
    m = json.loads(ok.stdout)  # stdout is pure JSON; the report goes to stderr
    assert m["vocab"]["kept"] == 258 and m["trim"]["quality"]["mean_kl"] < 1e-9
    again = cli(tiny_export, "-o", tmp_path / "o", "--keep-ids", tmp_path / "k.json", "--force", "--no-report")
    assert again.exit_code == 0 and "keeps 258 of 400 tokens" in again.output


def test_real_gpt2_tokenizer_has_256_byte_tokens():
    shared = Path("/work/shared/gpt2-tokenizer")
    if not (shared / "vocab.json").is_file():
        pytest.skip("the real GPT-2 tokenizer files are not available")
    tok = ByteLevelBPETokenizer(str(shared / "vocab.json"), str(shared / "merges.txt"))
    assert len(byte_token_ids(tok._tokenizer)) == 256
