"""The aarch64 lane's parity rule (scripts/aarch64_parity.py; docs/parity.md): exact ids, except a near-tie for
folders whose kernels quantize activations to int8 differently per CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "aarch64_parity.py"
spec = importlib.util.spec_from_file_location("aarch64_parity", SCRIPT)
parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parity)

# the prompt's 3 ids, then 4 generated ones with the top-2 gap of each step
WANT = {"ids": [1, 2, 3, 10, 11, 12, 13], "gaps": [0.9, 0.05, 0.5, 0.2]}


def test_equal_ids_pass_everywhere():
    assert parity.verdict("fp32", WANT, list(WANT["ids"]), tolerant=False) == (True, "equal")


def test_a_difference_at_a_near_tie_passes_only_where_tolerated():
    got = [1, 2, 3, 10, 99, 98, 97]  # differs at step 1, where x86's gap is 0.05 nats
    ok, what = parity.verdict("int8", WANT, got, tolerant=True)
    assert ok and "near-tie" in what and "step 1" in what
    assert parity.verdict("int4", WANT, got, tolerant=False)[0] is False


def test_a_difference_at_a_wide_gap_fails_even_where_tolerated():
    got = [1, 2, 3, 10, 11, 99, 98]  # step 2: gap 0.5 > NEAR_TIE
    ok, what = parity.verdict("int8", WANT, got, tolerant=True)
    assert not ok and "DIFFERS from step 2" in what


def test_which_folders_are_tolerated():
    recipe = lambda **r: {"quantization": {"recipe": r}}  # noqa: E731
    assert parity.near_tie_allowed(recipe(mode="int8"))
    assert parity.near_tie_allowed(recipe(mode="int4", target="arm64-dotprod", accuracy_level=4))
    assert not parity.near_tie_allowed(recipe(mode="int4", accuracy_level=4))  # the built-in int4: exact
    assert not parity.near_tie_allowed(recipe(mode="int4", target="arm64", accuracy_level=1))
    assert not parity.near_tie_allowed({})  # fp32
