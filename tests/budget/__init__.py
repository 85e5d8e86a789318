"""The budgets: memory, disk and input sizes bounded before work (memory.py, resources.py, input_limits.py)."""
