"""glibc's heap for a process that trains and evaluates in a loop: keep what it frees.

By default glibc serves an allocation above its mmap threshold with a fresh ``mmap`` and gives the
heap's free top back to the kernel above its trim threshold; both start at 128 KiB and move with
what the process frees. A client worker alternates the test split's evaluation (activations of
several MiB per layer) with small batched training steps, and its heap went back to the kernel and
came again every round: each time the pages were faulted in and zeroed anew. Measured on W1 (the
2-core AMD EPYC host, 150 rounds, medians of rounds 21-150): a worker's evaluation of 500 test
images took 19 ms (a fifth of the worker's CPU in the kernel) against 7 ms in a plain process;
with the two settings below, 10 ms, and a round 45 -> 37 ms (a round of Huang et al.'s DPAGD on
10 users, whose per-example gradients fill large buffers: 79-81 -> 57-62 s). Either setting alone
is slower than neither (19 -> 24-33 ms): setting one turns off glibc's moving thresholds, leaving
the other at 128 KiB.

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
