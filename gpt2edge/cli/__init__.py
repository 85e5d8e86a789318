"""The `gpt2edge` command: parses arguments, calls the library, prints. Nothing else lives here.

One module per group of commands (folders, generate, measure, serve, sparse) on the group in common.py, each
imported only when one of its commands runs (common.COMMAND_MODULES), and subpackages imported inside each
command, so `gpt2edge generate` imports neither torch nor the other commands' trees.
"""

from gpt2edge.cli.interrupts import guard_startup

guard_startup()  # before the heavy imports below: Ctrl-C while they load exits 130 without a traceback

from gpt2edge.cpu_facts import exit_on_arm32  # noqa: E402

exit_on_arm32()  # a 32-bit ARM Python has no onnxruntime: one line naming aarch64, before importing it

from gpt2edge.cli.common import main  # noqa: E402

__all__ = ["main"]
