"""Export parity against PyTorch (threshold: 1e-4 max abs diff, fp32) and the export folder contract."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gpt2edge.export.validate import hf_step, position_ids_from_mask
from gpt2edge.manifest import file_digest, load_manifest

ATOL = 1e-4  # fp32 log-probs and presents vs PyTorch (docs/parity.md)


def session(folder):
    return ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])


def run(sess, ids, mask, pos, past):
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, dict(zip(names, [ids, mask, pos, *past])))


def empty_past(cfg, batch):
    return [np.zeros((batch, cfg.n_head, 0, cfg.n_embd // cfg.n_head), np.float32) for _ in range(2 * cfg.n_layer)]


def test_io_names_follow_optimum(tiny_export, hf_model):
    sess = session(tiny_export)
    L = hf_model.config.n_layer
    assert [i.name for i in sess.get_inputs()][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert [i.name for i in sess.get_inputs()][3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in sess.get_outputs()] == ["logprobs"] + [
        f"present.{i}.{kv}" for i in range(L) for kv in ("key", "value")
    ]


def test_last_position_logprobs_and_presents_match_pytorch(tiny_export, hf_model):
    cfg = hf_model.config
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (3, 9), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    pos = position_ids_from_mask(mask, 9)
    out = run(session(tiny_export), ids, mask, pos, empty_past(cfg, 3))
    ref_lp, ref_presents = hf_step(hf_model, *map(torch.from_numpy, (ids, mask, pos)), None)
    assert out[0].shape == (3, cfg.vocab_size)
    assert np.abs(out[0] - ref_lp[:, -1].numpy()).max() < ATOL
    real = mask.astype(bool)
    for got, ref in zip(out[1:], ref_presents):
        assert got.shape == (3, cfg.n_head, 9, cfg.n_embd // cfg.n_head)
        assert np.abs(got - ref.numpy()).transpose(0, 2, 1, 3)[real].max() < ATOL


def test_decode_with_own_presents_equals_full_recompute(tiny_export, hf_model):
    cfg = hf_model.config
    sess = session(tiny_export)
    rng = np.random.default_rng(2)
    seq = rng.integers(0, cfg.vocab_size, (2, 13), dtype=np.int64)
    ids = seq[:, :5]
    mask = np.ones((2, 5), np.int64)
    out = run(sess, ids, mask, position_ids_from_mask(mask, 5), empty_past(cfg, 2))
    for step in range(8):  # 8 decode steps, feeding the graph's own presents back
        t = 5 + step
        mask = np.ones((2, t + 1), np.int64)
        out = run(sess, seq[:, t : t + 1], mask, position_ids_from_mask(mask, 1), out[1:])
        with torch.no_grad():
            full = torch.log_softmax(hf_model(torch.from_numpy(seq[:, : t + 1])).logits[:, -1], -1).numpy()
        maxdiff = np.abs(out[0] - full).max()
        assert maxdiff < ATOL, f"step {step}: maxdiff {maxdiff:.2e}"
        assert out[1].shape[2] == t + 1


def test_each_padded_row_equals_that_row_alone(tiny_export, hf_model):
    cfg = hf_model.config
    sess = session(tiny_export)
    rng = np.random.default_rng(3)
    a = rng.integers(0, cfg.vocab_size, 8, dtype=np.int64)
    b = rng.integers(0, cfg.vocab_size, 4, dtype=np.int64)
    ids = np.stack([a, np.concatenate([np.zeros(4, np.int64), b])])
    mask = np.stack([np.ones(8, np.int64), np.r_[np.zeros(4), np.ones(4)].astype(np.int64)])
    batched = run(sess, ids, mask, position_ids_from_mask(mask, 8), empty_past(cfg, 2))
    for row, tokens in enumerate([a, b]):
        m = np.ones((1, len(tokens)), np.int64)
        alone = run(sess, tokens[None], m, position_ids_from_mask(m, len(tokens)), empty_past(cfg, 1))
        assert np.abs(batched[0][row] - alone[0][0]).max() < ATOL
        # and one decode step on top of the batched cache still matches the row alone
    nxt = np.array([[5], [7]], np.int64)
    mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
    step = run(sess, nxt, mask2, position_ids_from_mask(mask2, 1), batched[1:])
    m = np.ones((1, 5), np.int64)
    alone = run(sess, np.r_[b, 7][None], m, position_ids_from_mask(m, 5), empty_past(cfg, 1))
    assert np.abs(step[0][1] - alone[0][0]).max() < ATOL


def test_head_all_matches_pytorch_at_every_real_position(tiny_export_all, hf_model):
    cfg = hf_model.config
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.vocab_size, (2, 10), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    pos = position_ids_from_mask(mask, 10)
    out = run(session(tiny_export_all), ids, mask, pos, empty_past(cfg, 2))
    ref_lp, _ = hf_step(hf_model, *map(torch.from_numpy, (ids, mask, pos)), None)
    assert out[0].shape == (2, 10, cfg.vocab_size)
    assert np.abs(out[0] - ref_lp.numpy())[mask.astype(bool)].max() < ATOL
    assert load_manifest(tiny_export_all).raw["graph"]["head"] == "all"


def test_manifest_checksums_and_contents(tiny_export, tiny_checkpoint):
    manifest = dict(load_manifest(tiny_export).raw)
    assert set(manifest["files"]) == {"model.onnx", "tokenizer.json", "config.json", "generation_config.json"}
    for rel, digest in manifest["files"].items():
        assert file_digest(tiny_export / rel) == digest
    assert manifest["source"]["path"] == str(tiny_checkpoint.resolve())
    assert manifest["graph"]["precision"] == "fp32" and manifest["graph"]["opset"] == 18
    assert manifest["dims"]["n_layer"] == 2
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(manifest["versions"])
    assert all(c["ok"] for c in manifest["validation"]["checks"])
    assert len(manifest["validation"]["checks"]) == 4


def test_tied_head_is_stored_once(tiny_export, hf_model):
    cfg = hf_model.config
    model = onnx.load(str(tiny_export / "model.onnx"))
    vocab_sized = [i for i in model.graph.initializer if cfg.vocab_size in i.dims]
    assert len(vocab_sized) == 1, [(i.name, list(i.dims)) for i in vocab_sized]


def test_folder_is_not_private(tiny_export):
    assert tiny_export.stat().st_mode & 0o055 == 0o055


def test_generation_config_and_tokenizer_are_copied(tiny_export, tiny_checkpoint):
    gen = json.loads((tiny_export / "generation_config.json").read_text())
    assert gen["eos_token_id"] == json.loads((tiny_checkpoint / "config.json").read_text())["eos_token_id"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_export / "tokenizer.json"))
    assert tok.decode(tok.encode("The river rose.").ids) == "The river rose."


@pytest.mark.parametrize("opset", [23])
def test_other_opset_exports_and_validates(tiny_checkpoint, tmp_path, opset):
    from gpt2edge.export import export_model

    result = export_model(str(tiny_checkpoint), tmp_path / "o", opset=opset)
    assert onnx.load(str(tmp_path / "o" / "model.onnx")).opset_import[0].version == opset
    assert all(c.ok for c in result.checks)


def test_large_graph_uses_external_data(tiny_checkpoint, tmp_path, monkeypatch):
    from gpt2edge.export import export_model, onnx_graph

    monkeypatch.setattr(onnx_graph, "EXTERNAL_DATA_THRESHOLD", 0)  # pretend the tiny model is over 2 GB
    result = export_model(str(tiny_checkpoint), tmp_path / "ext", run_validation=True)
    assert "model.onnx.data" in result.manifest["files"]
    assert result.manifest["graph"]["files"] == ["model.onnx", "model.onnx.data"]
    data_size = result.manifest["files"]["model.onnx.data"]["size"]
    assert (tmp_path / "ext" / "model.onnx").stat().st_size < data_size / 4  # weights live in the data file
