"""gpt2edge.bench: bench, sweep, probes."""
