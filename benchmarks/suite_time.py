"""The test suite's time before and after a change that moves test files: per test, matched across the move.

    python -m pytest -q --junitxml=OLD.xml     # in the old tree (both trees at once: the host's load hits both)
    python -m pytest -q --junitxml=NEW.xml     # in the new tree
    python benchmarks/suite_time.py OLD.xml NEW.xml [--top 10]

A test is matched by its module's file name, class and name (tests/test_x.py::f and tests/room/test_x.py::f are
one test), so a move into a room folder is not counted as a removed and an added test. Prints the totals of
both runs, of the tests they share and of those only one has, and the largest per-test changes.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET


def load(path: str) -> dict[str, float]:
    """JUnit XML -> {module file name[.class]::test name: seconds}."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        first = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        out[".".join(parts[first:]) + "::" + case.get("name", "")] = float(case.get("time", 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    old, new = load(args.old), load(args.new)
    both = old.keys() & new.keys()

    def total(times: dict[str, float], keys) -> float:
        return sum(times[k] for k in keys)

    print(f"old: {len(old)} tests, {total(old, old):.0f} s; new: {len(new)} tests, {total(new, new):.0f} s")
    shared_old, shared_new = total(old, both), total(new, both)
    ratio = shared_new / shared_old
    print(f"in both: {len(both)} tests, old {shared_old:.0f} s, new {shared_new:.0f} s ({ratio:.3f}x)")
    only_new, only_old = new.keys() - old.keys(), old.keys() - new.keys()
    print(f"only new: {len(only_new)} tests, {total(new, only_new):.0f} s; only old: {len(only_old)}, "
          f"{total(old, only_old):.0f} s")  # fmt: skip
    change = sorted(((new[k] - old[k], k) for k in both), reverse=True)
    for label, rows in (("slower", change[: args.top]), ("faster", change[::-1][: args.top])):
        print(f"most {label}:")
        for d, k in rows:
            print(f"  {d:+7.1f} s  {k} ({old[k]:.1f} -> {new[k]:.1f} s)")


if __name__ == "__main__":
    main()
