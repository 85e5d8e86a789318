"""The model and its cache: an export folder (folder), its ONNX Runtime sessions (ort_session), the graph as a
language model with its KV cache (lm, cache_rows, kv_cache, static_lm, columns), the per-call pool of them
(pool), and the tokenizer with its stop-string matcher (tokenizer). Nothing is imported here: import the module."""
