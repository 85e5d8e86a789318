"""`python -m gpt2edge.cli`: the same command as the `gpt2edge` script."""

from gpt2edge.cli import main

if __name__ == "__main__":
    main()
