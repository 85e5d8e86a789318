"""Hand freed heap memory back to the operating system between the phases of a long command.

glibc keeps what a process frees in its heap for later allocations, unless it sits at the top of the heap: after
quantize has read, rounded and written a model one matrix at a time (gpt2-large int8: 1.4 GB through arrays of
10-30 MB, under glibc's mmap threshold once it has grown), much of it stays resident while the quality report's
ONNX Runtime sessions load on top. malloc_trim(0) returns every free page. Elsewhere (musl, macOS, Windows)
this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def return_free_memory() -> bool:
    """Collect garbage, then ask glibc to release its free heap pages; False where there is no glibc."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # no glibc: its allocator returns memory by its own rules
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)  # returns 1 when it released something, 0 when nothing was free: either is fine
    return True
