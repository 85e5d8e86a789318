"""Short machine probes measured in the same run as a benchmark: memory read bandwidth and matmul GFLOP/s.

Decode of one token must read every weight once, so its floor is bytes / read bandwidth; prefill is
compute-bound, so its floor is FLOPs / matmul throughput. NumPy only: this runs on the device.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def read_bandwidth_gbs(threads: int = 2, mbytes: int = 256, repeat: int = 7) -> float:
    """Best-of-`repeat` GB/s of summing a buffer much larger than the caches, split over `threads` threads.

    NumPy's reductions release the GIL, so the threads read in parallel, like the matmul kernels do.
    """
    buf = np.ones(mbytes * (1 << 20) // 4, dtype=np.float32)
    chunks = np.array_split(buf, max(threads, 1))
    best = float("inf")
    with ThreadPoolExecutor(max(threads, 1)) as pool:
        list(pool.map(np.sum, chunks))  # fault the pages in before timing
        for _ in range(repeat):
            t0 = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def matmul_gflops(m: int = 128, k: int = 768, n: int = 3072, repeat: int = 10) -> float:
    """Best-of-`repeat` fp32 GFLOP/s of an (m, k) x (k, n) matmul: GPT-2 small's MLP shape at prefill.

    NumPy's BLAS uses its own thread pool (all cores unless OPENBLAS_NUM_THREADS / OMP_NUM_THREADS say
    otherwise)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9
