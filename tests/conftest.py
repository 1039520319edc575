"""Shared pytest configuration: GPU tests run only where a CUDA driver with VMM support exists."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cuda_available() -> bool:
    """True when the elastic-kv CUDA backend can open device 0 (driver present, VMM supported)."""
    try:
        from elastic_kv import _vmm

        _vmm.CudaBackend(0)
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not cuda_available():
        skip = pytest.mark.skip(reason="no CUDA driver with VMM support here (run ci/gpu.sh on a GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
