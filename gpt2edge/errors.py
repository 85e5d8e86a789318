"""Typed errors. Each message is a sentence that says what went wrong and what to do about it.

Kept free of torch and onnx imports so the runtime can use it on an edge device.
"""


class Gpt2EdgeError(Exception):
    """Base class of every error gpt2edge raises on purpose (the CLI prints it as one line, exit 1)."""


class CheckpointError(Gpt2EdgeError):
    """The source checkpoint cannot be found, is not GPT-2, or has no usable weights."""


class OutputFolderError(Gpt2EdgeError):
    """The output folder cannot be written: it overlaps the input, its parent is read-only, or the disk is full."""


class OutputExistsError(OutputFolderError):
    """The output folder exists and --force was not given (or does not allow replacing what is there)."""


class ExportError(Gpt2EdgeError):
    """Tracing or writing the ONNX graph failed, or an export option is not supported."""


class ValidationError(Gpt2EdgeError):
    """ONNX Runtime and PyTorch (or two variants) disagree beyond the stated tolerance."""


class ModelFolderError(Gpt2EdgeError):
    """A folder is not a gpt2edge export, or its files do not match its manifest."""


class ChecksumError(ModelFolderError):
    """A file's sha256 or size differs from the manifest. The message names no CLI flag: a command that can skip
    the check (--no-verify) adds that to it."""


class GenerationError(Gpt2EdgeError):
    """Invalid generation parameters, a prompt that does not fit, or a numerical failure while decoding."""


class DeviceError(Gpt2EdgeError):
    """The requested execution provider is not available in this onnxruntime build."""


class QuantizeError(Gpt2EdgeError):
    """An unsupported or pointless quantization request."""


class ConvertError(Gpt2EdgeError):
    """An export folder cannot be converted to the requested deployment format."""


class MissingExtraError(Gpt2EdgeError):
    """A command needs an optional extra (torch, onnx, ...) that this install does not have."""


class TrimError(Gpt2EdgeError):
    """A vocabulary-trimming request that cannot be honoured: a bad keep-list, corpus or folder."""


class ServeError(Gpt2EdgeError):
    """A server option is out of range, or the `serve` / `cluster` extra is not installed."""


class ArgumentTypeError(Gpt2EdgeError, TypeError):
    """A Python API call passed a value of the wrong type (None or bytes for a prompt, an int for stop strings).
    A TypeError too, so callers catch it as Python's own; the CLI prints it as one line like every error here."""


class SparseHeadError(Gpt2EdgeError):
    """A sparse-head request that cannot be honoured (`gpt2edge sparse-head`): a folder kind or option it does
    not support, or a bound table that does not match its folder."""


class ResourceError(Gpt2EdgeError):
    """The machine has less memory or disk than a request is estimated to need (checked before any work)."""


class SessionFileError(Gpt2EdgeError):
    """A saved session file cannot be written, or is refused on restore: not a session file, another format
    version, saved from another export folder, truncated, or damaged (its sha256 differs). The session is unchanged."""
