"""Run one timed command alone: under `flock $BENCH_LOCK` (/tmp/bench.lock, which every timing script here and
the peers' run.sh take), and say how much CPU other processes used meanwhile (from /proc/stat), so that a run
disturbed by unlocked work on a shared host can be told apart (and retried).

    from bench_lock import run_locked      # scripts in benchmarks/ (their folder is on sys.path)
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time

LOCK = os.environ.get("BENCH_LOCK", "/tmp/bench.lock")
TICKS = os.sysconf("SC_CLK_TCK")  # /proc/stat counts in these per second


def busy_ticks() -> int:
    """CPU ticks every process has used (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    return sum(int(p) for p in parts[1:4] + parts[6:8])


def load(seconds: float = 0.5) -> float:
    """CPUs busy per wall second over a short sleep."""
    b0, t0 = busy_ticks(), time.monotonic()
    time.sleep(seconds)
    return (busy_ticks() - b0) / TICKS / (time.monotonic() - t0)


def run_locked(cmd: list[str], wait_quiet: bool = False) -> tuple[str, float]:
    """stdout of cmd run under the bench lock, and the CPU other processes used per wall second meanwhile.
    wait_quiet: first wait (at most a minute) for a half second in which the machine is nearly idle."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for _ in range(120 if wait_quiet else 0):
            if load() < 0.08:
                break
        b0, t0, c0 = busy_ticks(), time.monotonic(), os.times()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        c1, b1, t1 = os.times(), busy_ticks(), time.monotonic()
    own = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    return out, max(0.0, (b1 - b0) / TICKS - own) / (t1 - t0)
