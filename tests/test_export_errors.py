"""Bad input to `gpt2edge export`: one clear line, non-zero exit, and no output folder afterwards."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main


def export_cli(*args):
    return CliRunner().invoke(main, ["export", *map(str, args)])


def leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")] if parent.exists() else []


def assert_failed(result, *phrases):
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: ")
    for phrase in phrases:
        assert phrase in line, line


def test_missing_path_that_is_not_a_hub_id(tmp_path):
    r = export_cli("-m", tmp_path / "nope", tmp_path / "out")
    assert_failed(r, "does not exist", "Hub id")
    assert not (tmp_path / "out").exists()


def test_hub_id_offline_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = export_cli("-m", "some-org/not-a-real-model-xyz", tmp_path / "out")
    assert_failed(r, "could not be fetched from the Hugging Face Hub", "offline")
    assert not (tmp_path / "out").exists()


def test_not_gpt2(tmp_path):
    ckpt = tmp_path / "bert"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    (ckpt / "model.safetensors").write_bytes(b"")
    r = export_cli("-m", ckpt, tmp_path / "out")
    assert_failed(r, "'bert' model", "GPT-2")
    assert not (tmp_path / "out").exists()


def test_folder_without_weights(tmp_path, tiny_checkpoint):
    ckpt = tmp_path / "noweights"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    r = export_cli("-m", ckpt, tmp_path / "out")
    assert_failed(r, "has no weights", "model.safetensors")
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_force(tmp_path, tiny_checkpoint, tiny_export):
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)  # an earlier export: the only kind of folder --force replaces
    (out / "keep.txt").write_text("mine")
    r = export_cli("-m", tiny_checkpoint, out)
    assert_failed(r, "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"  # untouched
    r = export_cli("-m", tiny_checkpoint, out, "--force", "--no-validate")
    assert r.exit_code == 0, r.output
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()
    assert leftovers(tmp_path) == []


def test_unsupported_opset(tmp_path, tiny_checkpoint):
    r = export_cli("-m", tiny_checkpoint, tmp_path / "out", "--opset", "11")
    assert_failed(r, "Opset 11 is not supported")
    assert not (tmp_path / "out").exists()


def test_pickle_weights_load_weights_only(tmp_path, tiny_checkpoint):
    """A pytorch_model.bin that would run code when unpickled is refused by the weights-only loader."""
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(ckpt / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Payload()}, f)
    r = export_cli("-m", ckpt, tmp_path / "out")
    assert_failed(r, "Cannot load the weights")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_validation_failure_leaves_nothing(tmp_path, tiny_checkpoint):
    r = export_cli("-m", tiny_checkpoint, tmp_path / "out", "--atol", "1e-30")
    assert_failed(r, "differs from PyTorch", "maxdiff")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_interrupt_leaves_nothing(tmp_path, tiny_checkpoint, monkeypatch):
    from gpt2edge.export import exporter

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "validate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        exporter.export_model(str(tiny_checkpoint), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []
