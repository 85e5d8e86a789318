"""Which optional extra a feature needs, checked before any work: a runtime-only install (`pip install
gpt2edge`, no torch, no onnx) gets one line naming the extra to install, not a ModuleNotFoundError.

Imports nothing above errors.py, and looks modules up without importing them (importing torch takes seconds).
"""

from __future__ import annotations

from importlib.util import find_spec

from gpt2edge.errors import MissingExtraError

# extra -> the top-level modules it installs (pyproject.toml [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "export": ("torch", "transformers", "onnx", "onnxscript", "safetensors"),
    "quantize": ("onnx",),
    "structured": ("llguidance",),
    "serve": ("fastapi", "uvicorn", "prometheus_client", "jinja2"),
    "cluster": ("fastapi", "uvicorn", "prometheus_client", "jinja2", "ray"),
}
# a bare `pip install torch` pulls the multi-GB CUDA build; the project pins the CPU wheel first
_TORCH_HINT = " (install torch==2.13.0 first: a bare torch requirement pulls the multi-GB CUDA build)"


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` that cannot be found in this environment."""
    missing = []
    for name in EXTRAS[extra]:
        try:
            found = find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or blocked package counts as absent
            found = False
        if not found:
            missing.append(name)
    return missing


def require_extra(extra: str, feature: str) -> None:
    """Raise MissingExtraError, naming the pip command, when `feature` cannot run without `extra`."""
    missing = missing_modules(extra)
    if missing:
        hint = _TORCH_HINT if "torch" in missing else ""
        raise MissingExtraError(
            f"gpt2edge {feature} needs the {extra} extra ({', '.join(missing)} not installed): "
            f"pip install 'gpt2edge[{extra}]'{hint}."
        )
