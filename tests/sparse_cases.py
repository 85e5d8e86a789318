"""The certificate's cases, shared by the graph step's check (FusedReader.certified, tests/test_sparse_head.py) and
the native one (g2e_rows, tests/test_sparse_native.py): both must take the same decisions. Four candidates
(ids, logits), the bar, k, and whether the k best are certified (TIE = 1e-3)."""

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
