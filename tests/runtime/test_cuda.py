"""CUDA execution provider: parity and the device-resident cache. Skipped where the provider is absent
(run them with `bash benchmarks/gpu_check.sh` on a machine with an NVIDIA GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpt2edge.export.validate import hf_step, position_ids_from_mask
from gpt2edge.quality import compare_folders
from gpt2edge.quantize import make_recipe, quantize_model
from gpt2edge.runtime import Generator, available_devices
from gpt2edge.runtime.model.lm import OrtLM

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif("cuda" not in available_devices(), reason="CUDA execution provider not available"),
]
CUDA_ATOL = 1e-3  # fp32 on GPU kernels (different reduction order) vs PyTorch on CPU


def test_cuda_logprobs_match_pytorch(tiny_export, hf_model):
    from gpt2edge.runtime.model.folder import ModelFolder

    lm = OrtLM(ModelFolder.open(tiny_export), device="cuda")
    ids = np.random.default_rng(0).integers(0, hf_model.config.vocab_size, (2, 9), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    lm.start(2, 16)
    got = lm.forward(ids, mask, position_ids_from_mask(mask, 9)).copy()
    ref, _ = hf_step(hf_model, *map(torch.from_numpy, (ids, mask, position_ids_from_mask(mask, 9))), None)
    assert np.abs(got - ref[:, -1].numpy()).max() < CUDA_ATOL


def test_cuda_cache_stays_on_device(tiny_export):
    g = Generator(tiny_export, device="cuda")
    g.generate(["The river", "Visitors walk"], max_new_tokens=16, ignore_eos=True)
    assert g.lm.cache.allocations == 1
    assert g.lm.cache._storage.device_name().lower() == "cuda"
    written = {o.data_ptr() for o in g.lm.binding.get_outputs()[1:]}  # where the last step's presents went
    assert written <= {g.lm.cache.pointer(s, t) for s in (0, 1) for t in range(g.lm.cache.n_tensors)}


def test_cuda_fp16_quality(tiny_export, tmp_path):
    out = tmp_path / "fp16"
    quantize_model(tiny_export, out, make_recipe("fp16"), report=False)
    report = compare_folders(tiny_export, out, device="cuda")
    assert report["mean_kl"] <= 1e-4 and report["max_abs_logprob_diff"] <= 5e-2, report
    assert len(Generator(out, device="cuda").generate("The", max_new_tokens=8, ignore_eos=True).token_ids) == 8
