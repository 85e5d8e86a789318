"""Reading and writing ONNX files without loading them whole: scanning, weight statistics, streamed saving,
external-data files."""
