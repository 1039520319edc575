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
            if physical_budget:
                pytest.skip("the CUDA backend has no budget of ours (OOM is tested on the host backend)")
            backend = _vmm.CudaBackend(0, multi_unmap=False if multi_unmap is False else None)
            if multi_unmap and not backend.multi_unmap:
                pytest.skip("this driver cannot unmap several mappings in one call")
            return backend
        raise AssertionError(backend_kind)

    return factory


# Fault-injection bookkeeping: every injection point records its outcome; the session prints a summary.

INJECTION_OUTCOMES = pytest.StashKey[list[tuple[str, str, str, str]]]()


@pytest.fixture
def injection_log(request: pytest.FixtureRequest) -> list[tuple[str, str, str, str]]:
    """Where test_fault_injection records (scenario, op, mode, outcome) per injection point."""
    return request.config.stash.setdefault(INJECTION_OUTCOMES, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    outcomes = config.stash.get(INJECTION_OUTCOMES, [])
    if not outcomes:
        return
    by_scenario: dict[str, dict[str, int]] = {}
    for scenario, _op, _mode, outcome in outcomes:
        counts = by_scenario.setdefault(scenario, {})
        counts[outcome] = counts.get(outcome, 0) + 1
    terminalreporter.section("fault injection")
    terminalreporter.write_line(
        f"{len(outcomes)} injection points checked (scenario x config x op x call x mode)"
    )
    for scenario, counts in sorted(by_scenario.items()):
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        terminalreporter.write_line(f"  {scenario:>10}: {sum(counts.values()):5d}  ({detail})")
