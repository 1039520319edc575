"""Fixtures of the data-plane tests: backends by name, so behaviour tests run on host (CI) and cuda (GPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from elastic_kv import _vmm

MiB = 1 << 20

BackendFactory = Callable[..., _vmm.Backend]


@pytest.fixture
def backend_kind() -> str:
    """Which backend the behaviour tests use; test_gpu_*.py modules override this with "cuda"."""
    return "host"


@pytest.fixture
def make_backend(backend_kind: str) -> BackendFactory:
    """A factory for fresh backends of `backend_kind`, emulating the GPU's 2 MiB granularity on the host."""

    def factory(physical_budget: int = 0, multi_unmap: bool | None = None) -> _vmm.Backend:
        if backend_kind == "host":
            return _vmm.HostBackend(
                granularity=2 * MiB,
                physical_budget=physical_budget,
                multi_unmap=True if multi_unmap is None else multi_unmap,
            )
        if backend_kind == "cuda":
            # The GPU has no budget of ours; tests that need OOM use the host backend or a fault injector.
            return _vmm.CudaBackend(0, multi_unmap=multi_unmap)
        raise AssertionError(backend_kind)

    return factory
