"""HF checkpoint -> ONNX graph with KV cache and a fused log-softmax head (needs the `export` extra)."""

from gpt2edge.export.exporter import ExportResult, export_model
from gpt2edge.export.random_checkpoint import make_random_checkpoint
from gpt2edge.export.validate import validate

__all__ = ["ExportResult", "export_model", "make_random_checkpoint", "validate"]
