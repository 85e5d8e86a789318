"""`gpt2edge sparse-head`: an export folder -> a folder whose LM head runs outside the graph, on a certified
subset of the vocabulary table per step (gpt2edge.runtime.sparse_head runs it)."""
