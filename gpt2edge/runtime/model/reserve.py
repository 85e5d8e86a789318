"""Memory a long-lived reservation will hold, checked against what the machine has before it is allocated.

A session (`generate -i`, Generator.session()) reserves its KV cache and mask for all of the model's
n_positions at once; a manifest whose n_positions is absurd (or a model whose context is larger than this
machine can hold) must be refused in one line naming the estimate, not end in numpy's "Unable to allocate
7.11 PiB" or the kernel's OOM killer.
"""

from __future__ import annotations

import os

import numpy as np

from gpt2edge.errors import GenerationError


def available_bytes() -> int | None:
    """Memory this process can still take: Linux's MemAvailable, else free physical pages; None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def context_bytes(lm, rows: int, positions: int) -> int:
    """KV cache (key and value of every layer) plus the int64 attention masks for `rows` x `positions`."""
    per_position = 2 * lm.n_layer * lm.n_head * lm.head_dim * np.dtype(lm.kv_dtype).itemsize + 2 * 8
    return rows * positions * per_position


def gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n < 2**50 else f"{n / 2**50:.3g} PiB"


def check_session_reservation(lm) -> None:
    """Refuse a session whose full-context reservation does not fit in the available memory."""
    need = context_bytes(lm, 1, int(lm.n_positions))
    have = available_bytes()
    if have is not None and need > have:
        raise GenerationError(
            f"A session reserves its context for all of the model's n_positions ({lm.n_positions}) at once: "
            f"~{gib(need)} of KV cache, but {gib(have)} of memory is available. Check n_positions in the folder's "
            "manifest.json and config.json (export the model again if it is wrong), or generate without -i / "
            "session(), which reserves only prompt + max_new_tokens positions."
        )
