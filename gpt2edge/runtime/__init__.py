"""Generation on ONNX Runtime with NumPy sampling. Needs numpy, onnxruntime and tokenizers; never torch.

The names below are imported on first use (PEP 562): importing one room of the runtime (gpt2edge.runtime.model's
folder and session, say) does not import every other room, so a CLI start can begin loading the model before
the decoding modules are imported (gpt2edge.runtime.open_model.GraphLoading)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpt2edge.runtime.decoding.sampling import SamplingParams
    from gpt2edge.runtime.generator import GenerationRequest, Generator
    from gpt2edge.runtime.model.folder import ModelFolder
    from gpt2edge.runtime.model.ort_session import available_devices
    from gpt2edge.runtime.results import GenerationResult

# each public name and the module that defines it
_HOMES = {
    "GenerationRequest": "gpt2edge.runtime.generator",
    "GenerationResult": "gpt2edge.runtime.results",
    "Generator": "gpt2edge.runtime.generator",
    "ModelFolder": "gpt2edge.runtime.model.folder",
    "SamplingParams": "gpt2edge.runtime.decoding.sampling",
    "available_devices": "gpt2edge.runtime.model.ort_session",
}

__all__ = ["GenerationRequest", "GenerationResult", "Generator", "ModelFolder", "SamplingParams", "available_devices"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once: later lookups find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
