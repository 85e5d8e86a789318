"""`parity`'s thresholds: each one given, its value and whether it held, said in the report (and in --json)."""

from __future__ import annotations

from typing import Any

import click

from gpt2edge.quality import THRESHOLD_KEYS


def threshold_checks(report: dict[str, Any], limits: dict[str, float | None]) -> list[dict[str, Any]]:
    """One record per threshold given: option, report key, operator, limit, value, ok."""
    out = []
    for name, limit in limits.items():
        if limit is None:
            continue
        key, op = THRESHOLD_KEYS[name]
        value = report[key]
        ok = value <= limit if op == "<=" else value >= limit
        out.append({"option": "--" + name.replace("_", "-"), "key": key, "op": op, "limit": limit, "value": value,
                    "ok": bool(ok)})  # fmt: skip
    return out


def print_thresholds(checks: list[dict[str, Any]], file) -> None:
    """The thresholds checked, one row each; or that none was given and which options set them."""
    if not checks:
        options = ", ".join("--" + n.replace("_", "-") for n in THRESHOLD_KEYS)
        click.echo(f"thresholds: none checked (pass {options} to fail the command when one is missed)", file=file)
        return
    click.echo("thresholds:", file=file)
    for c in checks:
        verdict = "ok" if c["ok"] else "FAILED"
        click.echo(f"  {c['key']} {c['op']} {c['limit']:g} ({c['option']}): {c['value']:.4g}  {verdict}", file=file)
