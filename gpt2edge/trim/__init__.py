"""Vocabulary trimming (`gpt2edge trim-vocab`): a folder whose LM head scores only a kept subset of tokens.

keep.py picks the ids, graph.py rewrites the head (needs onnx), report.py measures it (numpy only), handler.py
writes the folder. Nothing is imported here, so gpt2edge.quality can use report.py without onnx.
"""
