"""int8/int4 on models whose widths are not multiples of the block size: the manifest's recipe says what the graph
holds (the tied table's block must divide n_embd, so it may be smaller than asked), odd widths quantize, load and
generate, and a width no block of 16..256 divides is refused before the graph is read."""

from __future__ import annotations

import math

import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from gpt2edge.cli import main
from gpt2edge.errors import QuantizeError
from gpt2edge.manifest import load_manifest
from gpt2edge.quantize import make_recipe, quantize_model
from gpt2edge.runtime import Generator


def export_shape(root, n_embd: int, n_head: int, n_inner: int | None = None):
    """A seeded 1-layer GPT-2 of this shape (the in-process tokenizer), exported without validation."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2edge.export import export_model
    from gpt2edge.export.random_checkpoint import train_tokenizer

    tok = train_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_layer=1, n_head=n_head, n_embd=n_embd, n_inner=n_inner, n_positions=64,
                     bos_token_id=0, eos_token_id=0, initializer_range=0.2)  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    export_model(str(root / "ckpt"), root / "fp32", run_validation=False)
    return root / "fp32"


@pytest.fixture(scope="module")
def odd_export(tmp_path_factory):
    """n_embd 96 (the largest power-of-two block dividing it is 32) and an odd n_inner: no K is a multiple of 256."""
    return export_shape(tmp_path_factory.mktemp("odd"), 96, 4, n_inner=333)


@pytest.fixture(scope="module")
def no_block_export(tmp_path_factory):
    """n_embd 40: no power of two from 16 up divides it."""
    return export_shape(tmp_path_factory.mktemp("w40"), 40, 4)


def graph_recipe(folder, vocab: int) -> dict:
    """What the quantized graph holds, in the recipe's terms."""
    g = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    attrs = lambda n: {a.name: helper.get_attribute_value(a) for a in n.attribute}  # noqa: E731
    mm = [(attrs(n), len(n.input) > 3) for n in g.node if n.op_type == "MatMulNBits"]
    head = [a for a, _ in mm if a["N"] == vocab]
    layers = [a for a, _ in mm if a["N"] != vocab]
    positions = [attrs(n) for n in g.node if n.op_type == "GatherBlockQuantized" and n.input[0].startswith("wpe")]
    return {
        "weight_bits": {a["bits"] for a in layers},
        "block_size": {a["block_size"] for a in layers},
        "accuracy_level": {a.get("accuracy_level", 0) for a, _ in mm},
        "head_bits": {a["bits"] for a in head} or {None},
        "head_block_size": {a["block_size"] for a in head} or {None},
        "position_table_block_size": {a["block_size"] for a in positions},
        "symmetric": {not zp for _, zp in mm},
    }


def assert_recipe_is_the_graph(folder) -> dict:
    manifest = dict(load_manifest(folder).raw)
    recipe = manifest["quantization"]["recipe"]
    held = graph_recipe(folder, manifest["dims"]["vocab_size"])
    for key, values in held.items():
        assert values == {recipe[key]}, f"{key}: the manifest says {recipe[key]}, the graph holds {values}"
    return recipe


RECIPES = {
    "int4 default": dict(mode="int4"),
    "int4 4-bit head": dict(mode="int4", head_bits=4),
    "int4 symmetric block 32": dict(mode="int4", symmetric=True, block_size=32),
    "int4 4-bit symmetric head block 16": dict(mode="int4", head_bits=4, symmetric=True, block_size=16),
    "int8 default": dict(mode="int8"),
    "int4 fp32 head": dict(mode="int4", keep_head_fp32=True),
    "int8 float compute": dict(mode="int8", accuracy_level=0),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_recorded_recipe_is_what_the_graph_holds(tiny_export, tmp_path, name):
    """The tiny model is 64 wide: a head asked at block 128/256 is held at 64, and the manifest says 64."""
    quantize_model(tiny_export, tmp_path / "q", make_recipe(**RECIPES[name]), report=False)
    recipe = assert_recipe_is_the_graph(tmp_path / "q")
    if recipe["head_bits"] == 8:
        assert recipe["head_block_size"] == 64
    assert len(Generator(tmp_path / "q").generate("The", max_new_tokens=3, ignore_eos=True).token_ids) == 3


@pytest.mark.parametrize("name", ["int4 default", "int4 4-bit head", "int8 default"])
def test_odd_widths_quantize_load_generate_and_report(odd_export, tmp_path, name):
    manifest = quantize_model(odd_export, tmp_path / "q", make_recipe(**RECIPES[name]))
    recipe = assert_recipe_is_the_graph(tmp_path / "q")
    assert recipe["head_block_size"] == 32 and recipe["block_size"] == make_recipe(**RECIPES[name]).block_size
    q = manifest["quality"]
    assert math.isfinite(q["mean_kl"]) and 0 <= q["mean_kl"] < 1 and q["top1_agreement"] > 0.3, q
    r = Generator(tmp_path / "q").generate("The river", max_new_tokens=6, ignore_eos=True)
    assert len(r.token_ids) == 6


@pytest.mark.parametrize("args", [["--mode", "int4"], ["--mode", "int8"], ["--mode", "int4", "--keep-head-fp32"]])
def test_a_width_no_block_divides_is_refused_before_the_graph_is_read(no_block_export, tmp_path, monkeypatch, args):
    def never(*a, **k):
        raise AssertionError("the graph was loaded before the width was checked")

    monkeypatch.setattr(onnx, "load", never)
    out = tmp_path / "q"
    r = CliRunner().invoke(main, ["quantize", str(no_block_export), "-o", str(out), *args])
    assert r.exit_code == 1 and r.output.startswith("error: ") and len(r.output.splitlines()) == 1, r.output
    assert "n_embd=40" in r.output and "fp16" in r.output, r.output
    assert not out.exists()
    with pytest.raises(QuantizeError, match="n_embd=40"):
        make_recipe("int4").fitted(40)


def test_fp16_still_takes_such_a_width(no_block_export, tmp_path):
    quantize_model(no_block_export, tmp_path / "h", make_recipe("fp16"), report=False)
    assert len(Generator(tmp_path / "h").generate("The", max_new_tokens=3, ignore_eos=True).token_ids) == 3
