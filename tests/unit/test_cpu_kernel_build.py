"""Building and loading the native CPU kernels: a killed build's leftover lock does not hang."""

from __future__ import annotations

import subprocess
import sys

from hybridllm.layers.cpu_kernels import NAME, kernel_build_dir
from tests.kernel_helpers import require_cpu_kernels


def test_a_stale_build_lock_is_cleared():
    # cpp_extension leaves its `lock` file behind when a build is killed; every later process
    # used to wait on it forever. A fresh process must load the library anyway, and quickly.
    require_cpu_kernels()
    build_dir = kernel_build_dir()
    assert (build_dir / f"{NAME}.so").exists()
    lock = build_dir / "lock"
    lock.touch()
    code = "from hybridllm.layers.cpu_kernels import load_cpu_kernels as f; assert f()"
    done = subprocess.run([sys.executable, "-c", code], timeout=240, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert not lock.exists()
