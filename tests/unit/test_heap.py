"""training/heap.py: a process that keeps what it frees does not fault its pages in again.

Each case runs in a fresh interpreter (a fresh heap): allocate 16 MiB with the C library's malloc,
write every page, free it, three times, counting the minor page faults of each time."""
import ast
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, resource, sys
from dpfl_ray.training.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, faults = 16 << 20, []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print((kept, faults))
"""

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the thresholds are glibc's")


def _faults(mode: str):
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60, check=True)
    return ast.literal_eval(out.stdout.strip())


@glibc_only
def test_a_freed_block_is_reused_without_faulting_its_pages_again():
    kept, faults = _faults("kept")
    assert kept is True
    pages = (16 << 20) // 4096
    assert faults[0] >= pages // 8  # the first time its pages are faulted in (fewer with huge pages)
    assert faults[1] < 64 and faults[2] < 64  # then the heap keeps them


@glibc_only
def test_by_default_the_second_block_faults_its_pages_in_again():
    # the control: glibc's moving thresholds hand the first block back (its own mmap) and fault the
    # second in afresh from the heap, as a worker's evaluation buffers are without the setting
    kept, faults = _faults("plain")
    assert kept is None
    assert faults[1] >= faults[0] // 2 > 0


def test_setting_the_thresholds_twice_is_harmless():
    from dpfl_ray.training.heap import keep_freed_memory

    first = keep_freed_memory()
    assert keep_freed_memory() is first
