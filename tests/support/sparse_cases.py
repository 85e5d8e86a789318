"""What tests/runtime/test_sparse_head.py (the graph's certified step) and tests/runtime/test_sparse_native.py
(the native one) share: the certificate's cases, on which both checks must take the same decisions, and a
parent's head table cut into small groups, so that most groups are left out of a step."""

from __future__ import annotations

from pathlib import Path

# Four candidates (ids, logits), the bar, k, and whether the k best are certified (TIE = 1e-3).

NAN = float("nan")
ONE_TWO = [5.0, 4.0, 1.0, 0.5]
CERTIFICATE_CASES = [
    ([3, 4, 5, 7], ONE_TWO, 3.0, 1, True),
    ([3, 4, 5, 7], ONE_TWO, 4.9995, 1, False),  # within TIE of the bar
    ([3, 4, 5, 7], [5.0, 4.9995, 1.0, 0.5], 3.0, 1, False),  # within TIE of the runner-up
    ([3, 3, 5, 7], [5.0, 5.0, 1.0, 0.5], 0.0, 1, False),  # the best twice: not above its runner-up
    ([3, 4, 5, 7], ONE_TWO, NAN, 1, False),  # NaN: the outputs were not written
    ([3, 4, 5, 7], ONE_TWO, 0.0, 2, True),
    ([3, 3, 5, 7], [5.0, 5.0, 1.0, 0.5], 0.0, 2, False),  # the two best are one row
    ([3, 4, 5, 7], ONE_TWO, 3.9995, 2, False),
    ([3, 4, 5, 7], ONE_TWO, 0.0, 4, False),  # k must leave a runner-up among the K
]


def small_groups(parent: Path, vocab_size: int, width: int):
    """The parent folder's head table, bounded at rank 4 and cut into groups of 8 rows (16 clusters): the
    standalone graph of the fused step (16 candidates from 4 groups) and the native step's arrays for the same
    tables (gpt2edge.sparse.guard.step_arrays)."""
    import onnx

    from gpt2edge.sparse.bounds import bound_table
    from gpt2edge.sparse.fused import group_rows, slack_scale, standalone
    from gpt2edge.sparse.graph import split_head
    from gpt2edge.sparse.guard import step_arrays

    _, _, table = split_head(onnx.load(str(parent / "model.onnx")), vocab_size, width)
    bounds = bound_table(table.dequantized(), 4)
    groups = group_rows(bounds, bounds, size=8, clusters=16)
    model = standalone(table, bounds, groups, slack_scale(bounds), 16, 4)
    return model, step_arrays(bounds, groups, slack_scale(bounds))
