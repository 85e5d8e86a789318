"""FP16 / INT8 / INT4 variants of an export folder (needs onnx; no torch)."""

from gpt2edge.quantize.handler import MODES, Recipe, make_recipe, quantize_model

__all__ = ["MODES", "Recipe", "make_recipe", "quantize_model"]
