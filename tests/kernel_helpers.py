"""The native CPU kernels for the tests that exercise them.

Where the kernels cannot build those tests skip, but in CI (`CI=true`, which CI services set)
a failed build fails them: a compiler or build regression must not pass as a run of skips.
Kernels switched off on purpose (`HYBRIDLLM_CPU_KERNELS=0`) always skip.
"""

from __future__ import annotations

import os

import pytest

from hybridllm.layers.cpu_kernels import DISABLE_ENV, load_cpu_kernels


def cpu_kernels_disabled() -> bool:
    return os.environ.get(DISABLE_ENV) == "0"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def require_cpu_kernels() -> None:
    """Return once the kernels are loaded; else skip the test, or fail it when CI=true."""
    if cpu_kernels_disabled():
        pytest.skip(f"native CPU kernels disabled ({DISABLE_ENV}=0)")
    if load_cpu_kernels():
        return
    reason = "native CPU kernels did not build (see the logged warning)"
    if in_ci():
        pytest.fail(f"{reason}; with CI=true they must", pytrace=False)
    pytest.skip(f"{reason}: not buildable here")
