"""The folder-to-folder commands and their ground: export, quantize, convert, trim, sparse, quality, manifest,
folder, onnx_io."""
