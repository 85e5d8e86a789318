"""Vocabulary trimming (`gpt2edge trim-vocab`): a folder whose LM head scores only a kept subset of tokens.

keep.py picks the ids, graph.py rewrites the head (needs onnx), handler.py writes the folder; the report on the
kept ids is gpt2edge.quality.trimmed (the quality report's, which reads no trim module).
"""
