"""Memory a request will hold, estimated before any work, against what this machine has available.

A request whose estimate does not fit is refused with one line that names the estimate and its biggest parts,
instead of being killed by the kernel half-way (rc -9, no message). The estimate counts what grows with the
request (KV cache rows x context x layers x heads, beams, samples, batch, log-prob arrays, text held in memory),
not the model's weights, which are loaded already. Available memory is the smallest of: the kernel's
MemAvailable, the cgroup's limit minus its usage (containers), the address-space limit (ulimit -v), and
GPT2EDGE_MAX_MEMORY when set (e.g. 2G, 512M, or bytes: a cap for a shared machine, and what tests use).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpt2edge.errors import Gpt2EdgeError

ENV = "GPT2EDGE_MAX_MEMORY"
# what a request may plan to take of what is available: the rest is headroom for what no estimate sees
# (allocator slack, ONNX Runtime's arena, the other programs starting meanwhile)
SHARE = 0.8
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'2G', '512M', '1.5G', '1000000' -> bytes; ValueError when it is none of those."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.I)
    if not m:
        raise ValueError(text)
    return int(float(m[1]) * _UNITS[m[2].upper()])


def fmt_bytes(n: float) -> str:
    if n >= 1e15:
        return f"{n:.1e} bytes"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    """limit - usage of this process's cgroup (v2, else v1); None when unlimited or unknown."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                return None
            return max(0, int(limit) - int(Path(usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def _address_space_left() -> int | None:
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        used = 0
    return max(0, soft - used)


def available_bytes() -> int | None:
    """What this process can still allocate, as far as the OS says (see the module docstring); None: unknown."""
    found = [v for v in (_meminfo_available(), _cgroup_headroom(), _address_space_left()) if v is not None]
    cap = os.environ.get(ENV)
    if cap:
        try:
            found.append(parse_size(cap))
        except ValueError:
            raise Gpt2EdgeError(f"{ENV}={cap!r} is not a size; give bytes or e.g. 2G, 512M.") from None
    return min(found) if found else None


@dataclass(frozen=True)
class Estimate:
    """What a request will hold: named parts in bytes (a part may be astronomically large: Python ints)."""

    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)

    def describe(self) -> str:
        big = sorted((p for p in self.parts if p[1] > 0), key=lambda p: -p[1])[:3]
        return ", ".join(f"{name} {fmt_bytes(b)}" for name, b in big)


def check_fits(estimate: Estimate, what: str, hint: str, error: type[Gpt2EdgeError] = Gpt2EdgeError) -> None:
    """Raise `error` (one line: the estimate, its biggest parts, what is available, `hint`) when the estimate
    exceeds SHARE of the available memory. Unknown availability: nothing is refused."""
    avail = available_bytes()
    if avail is None or estimate.total <= SHARE * avail:
        return
    raise error(
        f"{what} would hold about {fmt_bytes(estimate.total)} of memory ({estimate.describe()}), more than the "
        f"{fmt_bytes(avail)} available; {hint}"
    )
