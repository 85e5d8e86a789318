"""Deployment formats of an export folder: ORT format for minimal/mobile ONNX Runtime builds, and
onnxruntime-genai's folder form (needs onnx for genai; no torch)."""

from gpt2edge.convert.handler import FORMATS, convert_folder

__all__ = ["FORMATS", "convert_folder"]
