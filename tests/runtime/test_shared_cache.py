"""The shared (in-place) KV cache graph: same results as the concat graph, one fused attention node per layer,
and the cache is one buffer that ONNX Runtime writes in place (never copied, never reallocated)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gpt2edge.errors import DeviceError, ModelFolderError, QuantizeError
from gpt2edge.export.validate import hf_step, position_ids_from_mask
from gpt2edge.manifest import load_manifest
from gpt2edge.quantize import make_recipe, quantize_model
from gpt2edge.runtime import Generator
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.lm import OrtLM
from gpt2edge.runtime.model.positions import left_pad

ATOL = 1e-4


def test_manifest_and_validation(tiny_export_shared):
    m = dict(load_manifest(tiny_export_shared).raw)
    assert m["graph"]["kv_cache"] == "shared"
    assert all(c["ok"] for c in m["validation"]["checks"]) and len(m["validation"]["checks"]) == 4
    assert m["graph"]["attention"] == "com.microsoft.GroupQueryAttention"
    present = next(o for o in m["graph"]["outputs"] if o["name"] == "present.0.key")
    assert present["shape"][2] == "max(past_seq, total_seq)"


def test_one_fused_attention_node_per_layer_and_no_cache_concat(tiny_export_shared):
    graph = onnx.load(str(tiny_export_shared / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    n_layer = load_manifest(tiny_export_shared).raw["dims"]["n_layer"]
    assert ops.count("GroupQueryAttention") == n_layer
    assert "Softmax" not in ops  # attention lives inside the fused node
    # no cache concat: each fused node reads its past straight from the graph's inputs, and the one Concat
    # left builds the (B, 1, S, T) shape of the padding bias from the inputs' shapes
    past = {i.name for i in graph.input if i.name.startswith("past_key_values.")}
    attn = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert {n.input[3] for n in attn} | {n.input[4] for n in attn} == past
    shapes = {n.output[0] for n in graph.node if n.op_type in ("Shape", "Constant")} | {
        i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT64
    }
    assert all(set(n.input) <= shapes for n in graph.node if n.op_type == "Concat")
    # every norm is the standard LayerNormalization (ln_1, ln_2 per layer, ln_f), none the slower fused one
    assert ops.count("LayerNormalization") == 2 * n_layer + 1 and "SkipLayerNormalization" not in ops


def test_graph_writes_into_a_larger_cache_buffer(tiny_export_shared, hf_model):
    """Decode on PyTorch's cache placed at the start of a bigger buffer whose spare slots hold garbage."""
    cfg = hf_model.config
    H, D = cfg.n_head, cfg.n_embd // cfg.n_head
    sess = ort.InferenceSession(str(tiny_export_shared / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 6), dtype=np.int64)
    mask = np.ones((1, 6), np.int64)
    _, past = hf_step(hf_model, *map(torch.from_numpy, (ids, mask, position_ids_from_mask(mask, 6))), None)
    cap = 20
    buffers = [np.concatenate([p.numpy(), np.full((1, H, cap - 6, D), 7.0, np.float32)], 2) for p in past]
    nxt, mask2 = np.array([[3]], np.int64), np.ones((1, 7), np.int64)
    names = [i.name for i in sess.get_inputs()]
    out = sess.run(None, dict(zip(names, [nxt, mask2, np.array([[6]]), *buffers])))
    ref_lp, ref_present = hf_step(hf_model, torch.from_numpy(nxt), torch.from_numpy(mask2), torch.tensor([[6]]), past)
    assert np.abs(out[0] - ref_lp[:, -1].numpy()).max() < ATOL
    assert out[1].shape == (1, H, cap, D)  # the buffer, with slot 6 written
    assert np.abs(out[1][:, :, :7] - ref_present[0].numpy()).max() < ATOL


def test_same_tokens_as_concat_graph(tiny_export, tiny_export_shared):
    prompts = ["Children learned to swim before they could read", "The city"]
    greedy = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    sampled = dict(max_new_tokens=32, temperature=0.9, top_p=0.95, seed=4, ignore_eos=True)
    concat, shared = Generator(tiny_export), Generator(tiny_export_shared)
    unbound = Generator(tiny_export_shared, io_binding=False)
    for kw in (greedy, sampled):
        ref = [r.token_ids for r in concat.generate(prompts, **kw)]
        assert [r.token_ids for r in shared.generate(prompts, **kw)] == ref
        assert [r.token_ids for r in unbound.generate(prompts, **kw)] == ref


def test_cache_is_allocated_once_and_never_rebound(tiny_export_shared):
    g = Generator(tiny_export_shared)
    cache = g.lm.cache
    addresses = []
    g.generate(
        "The river",
        max_new_tokens=20,
        ignore_eos=True,
        callback=lambda s: addresses.append({o.data_ptr() for o in g.lm.binding.get_outputs()[1:]}),
    )
    storage = cache._storage.ctypes.data
    assert cache.allocations == 1 and len(addresses) == 20
    buffers = {cache._storage[i].ctypes.data for i in range(cache.n_tensors)}
    assert all(a == buffers for a in addresses)  # ORT wrote into the cache itself, every step
    g.generate("The river", max_new_tokens=20, ignore_eos=True)
    assert cache.allocations == 1 and cache._storage.ctypes.data == storage


def test_decode_steps_touch_no_file_paths(tiny_export_shared, monkeypatch):
    """A step names its graph in the error context; resolving that path per step (symlinks, lstat per
    component) cost ~0.15 ms of an int4 GPT-2 small step. The folder's paths resolve once, at first use."""
    import os

    g = Generator(tiny_export_shared)
    g.generate("The river", max_new_tokens=2, ignore_eos=True)
    calls = []
    real = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    g.generate("The river", max_new_tokens=10, ignore_eos=True)
    assert calls == []
    assert g.lm.folder.graph_path == (tiny_export_shared / "model.onnx").resolve()


@pytest.mark.parametrize("io_binding", [True, False])
def test_batch_of_several_tokens_on_a_past_runs_row_by_row(tiny_export, tiny_export_shared, io_binding):
    """GroupQueryAttention refuses batch > 1 with seq > 1 on a past; OrtLM.forward runs such a step per row (in
    place, on each row's slice of the cache) and matches the concat graph, and so do the steps after it."""
    lms = [OrtLM(ModelFolder.open(f), io_binding=io_binding) for f in (tiny_export, tiny_export_shared)]
    prompts = [[5, 9, 13, 2, 7], [11, 4]]  # left-padded: row 1 has 3 pads
    chunks = [np.array([[3, 8, 1], [6, 2, 9]]), np.array([[4], [12]]), np.array([[14, 15], [16, 17]])]
    total = 5 + sum(c.shape[1] for c in chunks)
    ids, mask = left_pad(prompts, 0, total)
    outs = []
    for lm in lms:
        lm.start(2, total)
        m = mask.copy()
        steps = [lm.forward(ids, m[:, :5], position_ids_from_mask(m[:, :5], 5)).copy()]
        for chunk in chunks:  # (2, 3) then (2, 1) then (2, 2), each on top of the cache
            T = lm.past_len + chunk.shape[1]
            m[:, :T] = np.where(np.arange(T) >= 5, 1, m[:, :T])
            steps.append(lm.forward(chunk, m[:, :T], position_ids_from_mask(m[:, :T], chunk.shape[1])).copy())
        outs.append(steps)
    for concat, shared in zip(*outs):
        assert np.abs(concat - shared).max() < ATOL
    assert lms[1].past_len == total


def test_quantized_shared_variant_runs(tiny_export_shared, tmp_path):
    quantize_model(tiny_export_shared, tmp_path / "q", make_recipe("int4"))
    m = dict(load_manifest(tmp_path / "q").raw)
    assert m["graph"]["kv_cache"] == "shared" and m["quality"]["top1_agreement"] >= 0.5
    assert len(Generator(tmp_path / "q").generate("The", max_new_tokens=6, ignore_eos=True).token_ids) == 6


def test_cache_holds_the_sequence_after_generation(tiny_export_shared, hf_model):
    """What ORT wrote in place is PyTorch's cache of the whole sequence (prompt + generated tokens)."""
    g = Generator(tiny_export_shared)
    r = g.generate("The river", max_new_tokens=5, ignore_eos=True)
    ids = torch.tensor([r.prompt_token_ids + r.token_ids[:-1]])  # the last token was sampled, never fed back
    T = ids.shape[1]
    _, ref = hf_step(hf_model, ids, torch.ones_like(ids), torch.arange(T)[None], None)
    cache = g.lm.cache._storage  # (2 * n_layer, B, nh, capacity, hs)
    worst = max(float(np.abs(cache[i][:, :, :T] - p.numpy()).max()) for i, p in enumerate(ref))
    assert worst < ATOL, f"cache maxdiff {worst:.2e}"


def test_older_shared_export_is_refused(tiny_export_shared, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny_export_shared, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["graph"]["attention"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelFolderError, match="export it again"):
        Generator(old, verify=False)


def test_fp16_of_shared_export_is_refused_before_any_work(tiny_export_shared, tmp_path):
    with pytest.raises(QuantizeError, match="concat export"):
        quantize_model(tiny_export_shared, tmp_path / "h", make_recipe("fp16"))
    assert not (tmp_path / "h").exists()


def test_shared_graph_refuses_cuda(tiny_export_shared):
    with pytest.raises(DeviceError, match="shared KV cache"):
        Generator(tiny_export_shared, device="cuda")


@pytest.mark.parametrize(
    "overrides, fused_activation",
    [
        ({"activation_function": "gelu", "scale_attn_by_inverse_layer_idx": True}, "BiasGelu"),
        ({"activation_function": "relu", "scale_attn_weights": False}, None),
    ],
)
def test_fused_graph_follows_config_options(tiny_checkpoint, tmp_path, overrides, fused_activation):
    """Each branch of the fused blocks (erf GELU, plain activations, attention scales) matches PyTorch."""
    import shutil

    from gpt2edge.export import export_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **overrides}))
    result = export_model(str(ckpt), tmp_path / "out", kv_cache="shared")  # raises if validation fails
    assert all(c.ok for c in result.checks)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node}
    assert "GroupQueryAttention" in ops
    assert (fused_activation in ops) if fused_activation else not ops & {"FastGelu", "BiasGelu"}
