"""The tests, by room: one folder per package of gpt2edge (docs/layout.md maps them)."""
