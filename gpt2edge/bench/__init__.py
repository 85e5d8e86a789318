"""Benchmarks of an export folder against this machine's floors (numpy + onnxruntime; torch only for --vs-torch)."""

from gpt2edge.bench.bench import BenchConfig, run_bench, run_sweep

__all__ = ["BenchConfig", "run_bench", "run_sweep"]
