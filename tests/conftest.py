"""Shared pytest configuration: GPU tests run only where a CUDA driver with VMM support exists; a failing
test's report carries the tails of the engine logs watched at the time (:mod:`tests.support.engine_logs`).

Under pytest-xdist (``ci/test.sh`` runs ``-n 2 --dist loadscope``: a module, or a test class, runs whole on
one worker, so its module- and class-scoped engines are started once), each worker's vLLM engines compute
on the worker's own share of the CPUs, the modules that start engines are handed out first, and the
fault-injection summary covers every worker's tests.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # `tests.support` under a bare `pytest`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import engine_logs, injections


@functools.cache
def cuda_available() -> bool:
    """True when the elastic-kv CUDA backend can open device 0 (driver present, VMM supported)."""
    try:
        from elastic_kv import _vmm

        _vmm.CudaBackend(0)
    except Exception:
        return False
    return True


def pytest_configure(config: pytest.Config) -> None:
    _bind_vllm_to_the_workers_cpus(config)


def _bind_vllm_to_the_workers_cpus(config: pytest.Config) -> None:
    """On a pytest-xdist worker, unless ``VLLM_CPU_OMP_THREADS_BIND`` is set already: bind the compute
    threads of every vLLM engine this worker starts (in process or in a child) to the worker's share of
    the CPUs, so that the engines of two workers do not compute on one core while the other one idles
    (vLLM's ``auto`` binds every engine to the same cores). Engines with several ranks (TP, PP) set their
    own binding."""
    worker = getattr(config, "workerinput", None)
    if worker is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    count, index = int(worker["workercount"]), int(worker["workerid"].removeprefix("gw"))
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return
    share = cpus[index * len(cpus) // count : (index + 1) * len(cpus) // count]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not cuda_available():
        reason = "no CUDA driver with VMM support here (run ci/gpu.sh on a GPU machine)"
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if hasattr(config, "workerinput"):
        _engine_modules_first(items)


def _engine_modules_first(items: list[pytest.Item]) -> None:
    """Order whole modules (each keeps its own test order): those with a test marked ``slow``, then those
    with one marked ``vllm`` or ``sglang``, then the rest. pytest-xdist's ``loadscope`` hands modules out
    in this order (with ``--no-loadscope-reorder``), so the long ones start early and the short ones even
    out the workers' ends. Every worker computes the same order, as xdist requires."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    rank: dict[str, int] = {}
    for item in items:
        mine = 0 if "slow" in item.keywords else 1 if {"vllm", "sglang"} & set(item.keywords) else 2
        rank[module(item)] = min(rank.get(module(item), 2), mine)
    items.sort(key=lambda item: rank[module(item)])  # stable: file order otherwise


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller prints the summary
        workeroutput["injection_outcomes"] = injections.outcomes(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's controller: a worker finished; keep its fault-injection outcomes for the summary."""
    recorded = getattr(node, "workeroutput", {}).get("injection_outcomes", [])
    injections.outcomes(node.config).extend(tuple(o) for o in recorded)  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    injections.write_summary(terminalreporter, injections.outcomes(config))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        report.sections.extend(engine_logs.sections())
