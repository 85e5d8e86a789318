"""Bad input to `gpt2edge export`: one clear line, non-zero exit, and no output folder afterwards."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main


def export_cli(*args):
    return CliRunner().invoke(main, ["export", *map(str, args)])


def leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")] if parent.exists() else []


def assert_failed(result, *phrases):
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()[-1]
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
    from gpt2edge.errors import ExportError
    from gpt2edge.export import export_model

    r = export_cli("-m", tiny_checkpoint, tmp_path / "out", "--opset", "11")
    assert r.exit_code == 2 and "Invalid value for '--opset': 11 is not in the range 18<=x<=23" in r.output
    with pytest.raises(ExportError, match="Opset 11 is not supported; choose 18..23"):
        export_model(str(tiny_checkpoint), tmp_path / "out", opset=11)
    assert not (tmp_path / "out").exists()


def test_pickle_weights_load_weights_only(tmp_path, tiny_checkpoint):
    """A pytorch_model.bin that would run code when unpickled is refused by the weights-only loader."""
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # a good tokenizer: the load is reached
        (ckpt / name).write_text((tiny_checkpoint / name).read_text())
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
    import importlib

    from gpt2edge.export import exporter

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    # the module, not the function the package re-exports under the same name
    monkeypatch.setattr(importlib.import_module("gpt2edge.export.validate"), "validate_against", interrupted)
    with pytest.raises(KeyboardInterrupt):
        exporter.export_model(str(tiny_checkpoint), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def _edited_checkpoint(tiny_checkpoint, tmp_path, config=None, drop=(), add=None):
    """A copy of the tiny checkpoint whose config.json and/or safetensors keys were changed."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "edited"
    shutil.copytree(tiny_checkpoint, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    weights = {k: v for k, v in load_file(ckpt / "model.safetensors").items() if k not in drop}
    save_file({**weights, **(add or {})}, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt


def _zeros(*shape):
    import torch

    return torch.zeros(*shape)


@pytest.mark.parametrize(
    "edit, phrases",
    [
        (dict(config={"n_layer": 4}), ["n_layer=4 but the weights hold 2 layers", "missing"]),
        (dict(config={"n_layer": 1}), ["n_layer=1 but the weights hold 2 layers", "not part of the model"]),
        (
            dict(config={"n_embd": 32}),
            ["another shape than config.json implies", "(192,) in the weights, (96,) from the config"],
        ),
        (dict(drop=["transformer.h.1.mlp.c_fc.bias"]), ["1 weight(s) are missing", "h.1.mlp.c_fc.bias"]),
        (dict(add={"transformer.h.0.extra.weight": _zeros(3)}), ["not part of the model", "h.0.extra.weight"]),
    ],
    ids=["more-layers-in-config", "fewer-layers-in-config", "wrong-n_embd", "missing-key", "unexpected-key"],
)
def test_config_that_disagrees_with_its_weights_is_refused(tmp_path, tiny_checkpoint, edit, phrases):
    """No parameter of the graph may be random: transformers would initialise what is missing, and
    validation against that same random model would pass."""
    ckpt = _edited_checkpoint(tiny_checkpoint, tmp_path, **edit)
    r = export_cli("-m", ckpt, tmp_path / "out")
    assert_failed(r, "do not match its config.json", *phrases)
    assert len(r.output.strip().splitlines()) == 1, r.output  # no load report table, no progress bar
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_mask_buffers_and_absent_tied_head_are_fine(tmp_path, tiny_checkpoint):
    """Old checkpoints carry attn.bias / attn.masked_bias buffers and no lm_head (tied): both load."""
    from gpt2edge.export.checkpoint import load_checkpoint

    buffers = {f"transformer.h.{i}.attn.{b}": _zeros(1, 1, 4, 4) for i in range(2) for b in ("bias", "masked_bias")}
    ckpt = _edited_checkpoint(tiny_checkpoint, tmp_path, add=buffers)
    model = load_checkpoint(str(ckpt)).model
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_export_folder_as_source_is_named(tmp_path, tiny_export):
    r = export_cli("-m", tiny_export, tmp_path / "out")
    assert_failed(r, "is already a gpt2edge export", "gpt2edge quantize")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("atol", ["inf", "nan", "-1", "0"])
def test_atol_must_be_finite_and_positive(tmp_path, tiny_checkpoint, atol):
    r = export_cli("-m", tiny_checkpoint, tmp_path / "out", "--atol", atol)
    assert r.exit_code == 2 and "Invalid value for '--atol'" in r.stderr, r.output  # click's range, before any work
    from gpt2edge.errors import ExportError
    from gpt2edge.export import export_model

    with pytest.raises(ExportError, match="--atol must be a finite number > 0"):  # the library's own bound
        export_model(str(tiny_checkpoint), tmp_path / "out", atol=float(atol))
    assert not (tmp_path / "out").exists()


def test_hub_id_offline_fails_fast_in_a_fresh_process(tmp_path):
    """HF_HUB_OFFLINE is honoured as read at call time, with no network retries: a hang guard, not a
    benchmark (retrying took ~30 s)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty cache
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "gpt2edge.cli", "export", "-m", "some-org/not-a-real-model-xyz", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert time.monotonic() - t0 < 10
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: "), p.stderr
    assert "HF_HUB_OFFLINE" in p.stderr and "not in the local Hugging Face cache" in p.stderr
    assert "torch" not in p.stderr


def test_json_stdout_is_pure_and_no_progress_bar_off_a_terminal(tmp_path, tiny_checkpoint):
    """--json: stdout is the manifest alone, the validation table goes to stderr; CliRunner's stderr is not
    a TTY, so neither export's bar nor transformers' 'Loading weights' bar is drawn."""
    r = CliRunner().invoke(main, ["export", "-m", str(tiny_checkpoint), str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["format"] == "gpt2edge-export"
    assert r.stderr.startswith("validation (ONNX Runtime vs PyTorch"), r.stderr
    assert "it/s" not in r.stderr and "step" not in r.stderr and "\r" not in r.stderr, r.stderr


def test_unreachable_hub_fails_at_once_without_retries(tmp_path, monkeypatch):
    """Not marked offline, but no connection: one connection check, then one line (no per-file retries)."""
    from gpt2edge.export import hub

    monkeypatch.setattr(hub, "_hub_reachable", lambda: False)
    r = export_cli("-m", "some-org/not-a-real-model-xyz", tmp_path / "out")
    assert_failed(r, "the Hugging Face Hub is unreachable", "not in the local Hugging Face cache")
    assert len(r.output.strip().splitlines()) == 1


def test_offline_hub_id_loads_from_the_local_cache(tmp_path, tiny_checkpoint):
    """HF_HUB_OFFLINE=1 with the model in the Hugging Face cache: it loads from there, without the network."""
    snapshot = tmp_path / "hub" / "models--some-org--tiny" / "snapshots" / "0123abc"
    shutil.copytree(tiny_checkpoint, snapshot)
    (tmp_path / "hub" / "models--some-org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--some-org--tiny" / "refs" / "main").write_text("0123abc")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    code = "from gpt2edge.export.checkpoint import load_checkpoint; print(load_checkpoint('some-org/tiny').source)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "'kind': 'hub'" in p.stdout and "'model': 'some-org/tiny'" in p.stdout
