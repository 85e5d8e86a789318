"""Generation on ONNX Runtime with NumPy sampling. Needs numpy, onnxruntime and tokenizers; never torch."""

from gpt2edge.runtime.generator import GenerationResult, Generator
from gpt2edge.runtime.model_folder import ModelFolder
from gpt2edge.runtime.sampling import SamplingParams
from gpt2edge.runtime.session import available_devices

__all__ = ["GenerationResult", "Generator", "ModelFolder", "SamplingParams", "available_devices"]
