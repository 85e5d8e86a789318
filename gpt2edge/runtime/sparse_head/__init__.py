"""The certified sparse LM head (folders written by `gpt2edge sparse-head`): each step scores every token from a
small bound table, then computes the exact logit only for the rows whose upper bound can still win, so greedy
tokens and top-k distributions are the full head's. Steps it cannot certify, and calls that need the full
normaliser (top-p, min-p, typical-p, temperature-only sampling, penalties and bans, log-probs, beam search),
run the full head: the parent's own head graph. See docs/sparse-head.md."""

from gpt2edge.runtime.sparse_head.lm import SparseGraph, SparseLM, SparseStats
from gpt2edge.runtime.sparse_head.policy import sparse_k

__all__ = ["SparseGraph", "SparseLM", "SparseStats", "sparse_k"]
