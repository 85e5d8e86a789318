"""Budgets checked before work is spent: memory a request will hold (memory.py), the memory and disk a folder
command needs (needs.py), and bounded reads of text inputs (inputs.py). Ground: imports only gpt2edge.errors."""
