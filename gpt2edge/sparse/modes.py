"""The modes of `gpt2edge sparse-head` (a light module: the CLI reads it at import time).

exact: the certified head (gpt2edge.sparse.handler); the others are approximate, and are the modes the runtime's
approximate head accepts (gpt2edge.runtime.sparse_head.approx.MODES; tests/folders/test_sparse_approx.py checks the two
agree)."""

SPARSE_MODES = ("exact", "cluster")
