"""The `gpt2edge` command: parses arguments, calls the library, prints. Nothing else lives here.

One module per group of commands (folders, generate, measure, serve) on the group in common.py. Subpackages are
imported inside each command so `gpt2edge generate` never imports torch.
"""

from gpt2edge.cli import folders, generate, measure, serve, sparse  # noqa: F401  (they register their commands)
from gpt2edge.cli.common import main

__all__ = ["main"]
