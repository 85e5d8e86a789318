"""A command imports only its own module (gpt2edge/cli/common.py COMMAND_MODULES): `gpt2edge generate` starts
without the exporter's, quantizer's or server's trees, while help, listings and `main.commands` still see every
command."""

from __future__ import annotations

import json
import subprocess
import sys

from gpt2edge.cli import main
from gpt2edge.cli.common import COMMAND_MODULES


def test_the_table_names_the_module_of_every_command():
    registered = {name: cmd.callback.__module__ for name, cmd in main.commands.items()}
    assert registered == {name: f"gpt2edge.cli.{module}" for name, module in COMMAND_MODULES.items()}


# trees a generation never needs: each one's import is start-up time lost
NOT_FOR_GENERATE = (
    "gpt2edge.cli.folders", "gpt2edge.cli.measure", "gpt2edge.cli.serve", "gpt2edge.cli.sparse", "gpt2edge.export",
    "gpt2edge.quantize", "gpt2edge.serve", "gpt2edge.convert", "gpt2edge.trim", "gpt2edge.bench", "tqdm", "torch",
    "numpy.ma.core",  # np.median's (~12 ms at exit: results.py takes the median itself)
)  # fmt: skip


def modules_after(args: list[str]) -> list[str]:
    """The modules a fresh interpreter holds after running `gpt2edge ARGS` (a subprocess: this one has them all)."""
    code = (
        "import json, sys\n"
        "from gpt2edge.cli import main\n"
        f"try:\n    main({args!r}, standalone_mode=False)\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(out.stderr.strip().splitlines()[-1])


def test_generate_imports_no_other_commands_tree(tiny_export):
    loaded = modules_after(["generate", str(tiny_export), "-p", "Hello", "-n", "2", "--greedy"])
    assert "gpt2edge.cli.generate" in loaded and "gpt2edge.runtime.generator" in loaded
    assert [m for m in loaded if m.startswith(NOT_FOR_GENERATE)] == []


def test_help_lists_every_command():
    loaded = modules_after(["--help"])
    assert {f"gpt2edge.cli.{m}" for m in COMMAND_MODULES.values()} <= set(loaded)


def test_an_unknown_command_is_refused_with_a_suggestion():
    out = subprocess.run(
        [sys.executable, "-m", "gpt2edge.cli", "generat"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "No such command 'generat'" in out.stderr and "generate" in out.stderr
