"""Generation on ONNX Runtime with NumPy sampling. Needs numpy, onnxruntime and tokenizers; never torch."""

from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.generator import GenerationRequest, Generator
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.model.ort_session import available_devices
from gpt2edge.runtime.results import GenerationResult

__all__ = ["GenerationRequest", "GenerationResult", "Generator", "ModelFolder", "SamplingParams", "available_devices"]
