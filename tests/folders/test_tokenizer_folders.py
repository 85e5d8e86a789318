"""A tokenizer that cannot be the model's is one `error:` line before any work, and no output folder is left:
a folder with no tokenizer files, a missing path, a file, an empty vocabulary, one bigger than the model's
embedding or far smaller (the model's end-of-text id outside it), one whose end-of-text id is not the model's.
An export folder whose tokenizer.json is empty, corrupt or too big for its graph is one line at generate time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpt2edge.manifest import MANIFEST_NAME, file_digest
from tests.support import cli, one_error_line


def tokenizer_json(vocab_size: int = 400, empty: bool = False) -> str:
    """A byte-level BPE tokenizer.json (train_tokenizer's), or the same with no vocabulary and no merges."""
    from gpt2edge.export.random_checkpoint import train_tokenizer

    data = json.loads(train_tokenizer(vocab_size).backend_tokenizer.to_str())
    if empty:  # what export wrote from a folder with no tokenizer files: only <|endoftext|>, added
        data["model"]["vocab"], data["model"]["merges"] = {}, []
    return json.dumps(data)


def tokenizer_folder(root: Path, name: str, **kw) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tokenizer_json(**kw))
    return folder


def bad_tokenizers(root: Path) -> dict[str, tuple[Path | str, str]]:
    """name -> (--tokenizer value, a phrase of its error) for what neither command may take."""
    no_files = root / "no-files"  # like /etc: a folder, but no tokenizer in it
    no_files.mkdir()
    (no_files / "README").write_text("not a tokenizer")
    (no_files / "vocab.json").write_text("{}")  # half of the BPE pair is not a tokenizer
    return {
        "no-files": (no_files, "has no tokenizer files"),
        "missing-path": (root / "nope" / "tok", "does not exist"),
        "file": (no_files / "README", "is a file"),
        "empty-vocab": (tokenizer_folder(root, "empty", empty=True), "empty vocabulary"),
    }


@pytest.mark.parametrize("case", ["no-files", "missing-path", "file", "empty-vocab", "hub-looking-name"])
def test_random_checkpoint_refuses_a_tokenizer_that_is_not_one(tmp_path, case):
    cases = bad_tokenizers(tmp_path)
    # random-checkpoint takes a folder: a bare name is a missing folder, never a hub lookup
    cases["hub-looking-name"] = ("nonexist", "does not exist")
    value, phrase = cases[case]
    r = cli("random-checkpoint", tmp_path / "ckpt", "--size", "mini", "--tokenizer", value)
    one_error_line(r, phrase)
    assert not (tmp_path / "ckpt").exists()


def test_random_checkpoint_takes_a_vocab_and_merges_folder(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    from gpt2edge.export.random_checkpoint import EOS
    from gpt2edge.sample_text import SAMPLE_TEXT

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(SAMPLE_TEXT.splitlines(), vocab_size=300, special_tokens=[EOS])
    (tmp_path / "tok").mkdir()
    bpe.save_model(str(tmp_path / "tok"))  # vocab.json + merges.txt only
    r = cli("random-checkpoint", tmp_path / "ckpt", "--tokenizer", tmp_path / "tok")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["vocab_size"] == 300


def checkpoint_copy(src: Path, dst: Path, drop_tokenizer: bool = False, **config) -> Path:
    shutil.copytree(src, dst)
    if drop_tokenizer:
        for p in dst.iterdir():
            if p.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
                p.unlink()
    if config:
        path = dst / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


@pytest.mark.parametrize("case", ["no-files", "missing-path", "file", "empty-vocab", "offline-hub-id"])
def test_export_refuses_a_tokenizer_that_is_not_one(tiny_checkpoint, tmp_path, monkeypatch, case):
    cases = bad_tokenizers(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is looked up in the (empty) cache only
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cases["offline-hub-id"] = ("nonexist-org/nonexist-tokenizer", "could not be fetched")
    value, phrase = cases[case]
    r = cli("export", "-m", tiny_checkpoint, tmp_path / "out", "--tokenizer", value, "--no-validate")
    one_error_line(r, phrase)
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_tokenizer_that_is_not_the_models(tiny_checkpoint, tmp_path):
    # bigger: ids the 400-row embedding has no row for
    bigger = tokenizer_folder(tmp_path, "bigger", vocab_size=600)
    r = cli("export", "-m", tiny_checkpoint, tmp_path / "a", "--tokenizer", bigger, "--no-validate")
    one_error_line(r, "tokens but the model only 400")
    # far smaller: a 1000-row model whose end-of-text is id 999, with the 400-token tokenizer
    far = checkpoint_copy(tiny_checkpoint, tmp_path / "far", vocab_size=1000, eos_token_id=999, bos_token_id=999)
    r = cli("export", "-m", far, tmp_path / "b", "--no-validate")
    one_error_line(r, "eos_token_id 999 is past the tokenizer's 400 tokens")
    # the same size, but the model's end-of-text is another id than the tokenizer's
    shifted = checkpoint_copy(tiny_checkpoint, tmp_path / "shifted", eos_token_id=7, bos_token_id=7)
    r = cli("export", "-m", shifted, tmp_path / "c", "--no-validate")
    one_error_line(r, "'<|endoftext|>' is id 0 but the model's eos_token_id is 7")
    # a checkpoint with no tokenizer of its own and no --tokenizer
    bare = checkpoint_copy(tiny_checkpoint, tmp_path / "bare", drop_tokenizer=True)
    r = cli("export", "-m", bare, tmp_path / "d", "--no-validate")
    one_error_line(r, "has no tokenizer files", "--tokenizer DIR")
    assert not any((tmp_path / n).exists() for n in "abcd")


def with_tokenizer(tiny_export: Path, dst: Path, text: str) -> Path:
    """A copy of the export whose tokenizer.json is `text`, the manifest's digest updated to match it."""
    shutil.copytree(tiny_export, dst)
    (dst / "tokenizer.json").write_text(text)
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    manifest["files"]["tokenizer.json"] = file_digest(dst / "tokenizer.json")
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    return dst


@pytest.mark.parametrize(
    "case, phrase",
    [
        ("empty-vocab", "empty vocabulary"),
        ("bigger", "has 600 tokens but the model's embedding only 400 rows"),
        ("empty-file", "is not a readable tokenizer.json"),
        ("corrupt", "is not a readable tokenizer.json"),
        ("not-a-tokenizer", "is not a readable tokenizer.json"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "score"])
def test_a_folder_whose_tokenizer_is_not_the_models_is_one_line(tiny_export, tmp_path, case, phrase, command):
    text = {
        "empty-vocab": lambda: tokenizer_json(empty=True),
        "bigger": lambda: tokenizer_json(vocab_size=600),
        "empty-file": lambda: "",
        "corrupt": lambda: tokenizer_json()[:5000],
        "not-a-tokenizer": lambda: "[]",
    }[case]()
    folder = with_tokenizer(tiny_export, tmp_path / "m", text)
    (tmp_path / "t.txt").write_text("The river rose and the city slept. " * 4)
    args = ["-p", "The river", "-n", "3"] if command == "generate" else [tmp_path / "t.txt"]
    one_error_line(cli(command, folder, *args), phrase)
