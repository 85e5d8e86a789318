"""generate options that a mode cannot honour are refused, not silently dropped."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpt2edge.cli import main


@pytest.mark.parametrize(
    "extra",
    [["--num-beams", "2"], ["--num-return-sequences", "2", "--do-sample"], ["--length-penalty", "2"],
     ["--early-stopping", "true"]],
)  # fmt: skip
def test_interactive_refuses_beam_search_options(tiny_export, extra):
    out = CliRunner().invoke(main, ["generate", str(tiny_export), "-i", "-n", "3", *extra], input="hello\n")
    assert out.exit_code == 2, out.output
    assert "-i" in out.output and extra[0] in out.output
    assert "Traceback" not in out.output
