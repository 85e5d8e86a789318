"""docs/ and README.md: links, command lines against the live CLI, the how-tos' Python blocks."""
