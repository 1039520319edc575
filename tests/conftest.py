"""Shared pytest configuration: GPU tests run only where a CUDA driver with VMM support exists; a failing
test's report carries the tails of the engine logs watched at the time (:mod:`tests.support.engine_logs`)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # `tests.support` under a bare `pytest`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import engine_logs


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
        reason = "no CUDA driver with VMM support here (run ci/gpu.sh on a GPU machine)"
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        report.sections.extend(engine_logs.sections())
