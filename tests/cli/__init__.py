"""gpt2edge.cli: every command's options, errors and terminal behaviour."""
