"""Short machine probes measured in the same run as a benchmark: memory read bandwidth and matmul GFLOP/s.

Decode of one token must read every weight once, so its floor is bytes / read bandwidth (unless those bytes
fit in the last-level cache, whose size is read here too); prefill is compute-bound, so its floor is FLOPs /
matmul throughput. NumPy only: this runs on the device.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_cache_size(text: str) -> int:
    """sysfs cache size ('32768K', '8M', '512') -> bytes; ValueError when it is none of these."""
    t = text.strip().upper()
    if t[-1:] in _SIZE_UNITS:
        return int(t[:-1]) * _SIZE_UNITS[t[-1]]
    return int(t)


def last_level_cache_bytes(caches: Path = CPU0_CACHES) -> int | None:
    """Bytes of cpu0's highest-level data or unified cache: sysfs (Linux), else sysconf; None when unknown."""
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted(caches.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((index / "level").read_text()), parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue  # a missing or odd entry: use the others
        if size > 0 and (best is None or level > best[0]):
            best = (level, size)
    if best is not None:
        return best[1]
    try:  # glibc's sysconf (0 or -1 when it does not know)
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return size if size > 0 else None
