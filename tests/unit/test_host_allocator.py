"""keep_freed_memory: a step's large buffers reuse memory instead of faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a process of its own (the setting is process-wide): allocate, touch and free a 64 MB block
# five times and count the minor page faults of the last four.
SCRIPT = """
import ctypes, resource, sys
from hybridllm.worker.host_allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
def cycle():
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    cycle()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_blocks_are_reused_not_faulted_in_again():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    kept, kept_faults = faults("keep")
    if not kept:
        pytest.skip("not glibc: nothing to keep")
    _, default_faults = faults("default")
    pages = 4 * (64 << 20) // 4096
    # by default each cycle maps the block fresh: a fault per 4 KB page (fewer with huge pages)
    assert default_faults > pages // 8
    assert kept_faults < pages // 100
