"""Static-shape graphs (prototype, gpt2edge.export.static): no symbolic dimension, one NNAPI / CoreML ML Program
partition by ONNX Runtime's own mobile usability checker, and the same greedy tokens as the dynamic export."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpt2edge.errors import ExportError, GenerationError
from gpt2edge.export.model import from_hf_model
from gpt2edge.export.static import (
    DECODE_FILE,
    PREFILL_FILE,
    WEIGHTS_FILE,
    StaticShape,
    export_static,
    parse_static,
    symbolic_values,
)
from gpt2edge.runtime import Generator
from gpt2edge.runtime.lm import LMPool
from gpt2edge.runtime.static_lm import StaticLM

SHAPE = StaticShape(batch=2, chunk=8, capacity=64)
GREEDY = dict(max_new_tokens=16, do_sample=False, ignore_eos=True)


@pytest.fixture(scope="module")
def static_dir(hf_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("static")
    assert export_static(from_hf_model(hf_model), out, SHAPE) == [PREFILL_FILE, DECODE_FILE, WEIGHTS_FILE]
    return out


def test_two_graphs_store_the_weights_once(static_dir, hf_model):
    weights = sum(p.numel() * 4 for p in from_hf_model(hf_model).parameters())
    sizes = {p.name: p.stat().st_size for p in static_dir.iterdir()}
    assert 0.9 * weights < sizes[WEIGHTS_FILE] < 1.01 * weights  # one copy (tensors under 1 kB stay inline)
    # each graph file is its nodes (and their export metadata) only: far less than a copy of the weights
    assert sizes[PREFILL_FILE] < 0.5 * weights and sizes[DECODE_FILE] < 0.5 * weights


@pytest.fixture(scope="module")
def static_gen(tiny_export, static_dir) -> Generator:
    """The ordinary Generator (tokenizer, sampler, generation loop) with the static graphs as its model."""
    gen = Generator(tiny_export)
    gen._pool = LMPool(None, factory=lambda: StaticLM(static_dir / PREFILL_FILE, static_dir / DECODE_FILE))
    gen.lm = gen._pool.primary
    return gen


@pytest.mark.parametrize("name", [PREFILL_FILE, DECODE_FILE])
def test_no_symbolic_dimension_anywhere(static_dir, name):
    assert symbolic_values(static_dir / name) == []


@pytest.mark.parametrize("name", [PREFILL_FILE, DECODE_FILE])
def test_mobile_usability_checker_gives_nnapi_and_coreml_one_partition(static_dir, name, tmp_path):
    # what `python -m onnxruntime.tools.check_onnx_model_mobile_usability` runs: basic optimization, shape
    # inference, then ONNX Runtime's partitioning estimate with every input size required to be fixed
    from onnxruntime.tools.mobile_helpers import usability_checker as uc
    from onnxruntime.tools.onnx_model_utils import ModelProtoWithShapeInfo, optimize_model

    optimized = tmp_path / name
    optimize_model(static_dir / name, optimized, use_external_initializers=True)
    model = ModelProtoWithShapeInfo(optimized).model_with_shape_info
    assert uc.check_shapes(model.graph) == ([], 0)  # no dynamic input, no dynamic value
    yes = uc.PartitioningInfo.TryWithEP.YES
    nnapi = uc.check_nnapi_partitions(model, require_fixed_input_sizes=True)
    assert nnapi.num_partitions == 1 and nnapi.suitability() == yes
    coreml = uc.check_coreml_partitions(model, True, "coreml_supported_mlprogram_ops.md")
    assert coreml.num_partitions == 1 and coreml.suitability() == yes


def test_greedy_tokens_equal_the_dynamic_export(tiny_export, static_gen):
    dynamic = Generator(tiny_export)
    # 4 tokens (one padded chunk), and a prompt over two chunks of 8 with a padded last chunk
    for prompt in ["The river rose and", "Visitors came to the old town to see the bridge and the river"]:
        assert len(dynamic.tokenizer.encode(prompt)) != SHAPE.chunk
        assert static_gen.generate(prompt, **GREEDY).token_ids == dynamic.generate(prompt, **GREEDY).token_ids


def test_left_padded_batch_equals_the_dynamic_export(tiny_export, static_gen):
    prompts = ["The river rose and", "Visitors came to the old town to see the bridge"]
    ours = [r.token_ids for r in static_gen.generate(prompts, **GREEDY)]
    assert ours == [r.token_ids for r in Generator(tiny_export).generate(prompts, **GREEDY)]


def test_capacity_and_batch_limits_are_clear_errors(static_gen):
    with pytest.raises(GenerationError, match="64 positions"):
        static_gen.generate("The river rose and", max_new_tokens=70, ignore_eos=True)
    with pytest.raises(GenerationError, match="at most 2 rows"):
        static_gen.generate(["a", "b", "c"], max_new_tokens=2)


@pytest.mark.parametrize(
    "spec, phrase",
    [("1x64", "BATCHxCHUNKxCAPACITY"), ("0x8x64", ">= 1"), ("1x128x64", "cannot exceed"), ("1x8x4096", "exceeds")],
)
def test_bad_static_specs(spec, phrase):
    with pytest.raises(ExportError, match=phrase):
        parse_static(spec, n_positions=1024)
    assert parse_static("1X64x1024", 1024) == StaticShape(1, 64, 1024)
