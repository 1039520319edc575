"""Fixtures of the data-plane tests: backends by name, so behaviour tests run on host (CI) and cuda (GPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from elastic_kv import _vmm

from tests.support import injections
from tests.support.injections import Outcome

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
            if physical_budget:
                pytest.skip("the CUDA backend has no budget of ours (OOM is tested on the host backend)")
            backend = _vmm.CudaBackend(0, multi_unmap=False if multi_unmap is False else None)
            if multi_unmap and not backend.multi_unmap:
                pytest.skip("this driver cannot unmap several mappings in one call")
            return backend
        raise AssertionError(backend_kind)

    return factory


@pytest.fixture
def injection_log(request: pytest.FixtureRequest) -> list[Outcome]:
    """Where test_fault_injection records (scenario, op, mode, outcome) per injection point; the run ends
    with their summary (:mod:`tests.support.injections`)."""
    return injections.outcomes(request.config)
