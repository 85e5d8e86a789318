"""Benchmarks of an export folder against this machine's floors (numpy + onnxruntime; torch only for --vs-torch)."""

from gpt2edge.bench.bench import run_bench
from gpt2edge.bench.sweep import run_sweep
from gpt2edge.bench.workload import BenchConfig

__all__ = ["BenchConfig", "run_bench", "run_sweep"]
