"""gpt2edge: export GPT-2-family checkpoints to ONNX, shrink them, and generate on ONNX Runtime."""

__version__ = "0.1.0"
