"""glibc's heap for a process that trains and evaluates in a loop: keep what it frees.

By default glibc serves an allocation above its mmap threshold with a fresh ``mmap`` and gives the
heap's free top back to the kernel above its trim threshold; both start at 128 KiB and move with
what the process frees. A client worker alternates the test split's evaluation (activations of
several MiB per layer) with batched training steps or per-example gradients of other sizes, so under
those defaults its large buffers go back to the kernel and are faulted in and zeroed anew round
after round. With the mmap threshold at its largest and trimming above 1 GiB only, the heap keeps
them: a W1 worker's evaluation costs about half the CPU, Huang et al.'s DPAGD round about three
quarters (benchmarks/RESULTS.md, "A worker's heap kept between rounds"). Both are set: setting
either alone turns off glibc's moving thresholds and leaves the other at 128 KiB, slower than neither.

The cost is memory: a process keeps its high-water mark of heap instead of returning it between
rounds. A worker reaches that mark every round anyway.
"""
from __future__ import annotations

import ctypes
import platform

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): allocations above it still get an
# mmap of their own, and give it back when freed.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30

_kept = False


def keep_freed_memory() -> bool:
    """Set the two thresholds for this process (once); False where the C library is not glibc."""
    global _kept
    if _kept:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return _kept
