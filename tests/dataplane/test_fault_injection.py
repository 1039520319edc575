"""Fault injection at every call position of every backend operation, in every data-plane operation.

For each scenario (create, map, unmap, prepare, commit, abort, map_async) and each configuration (handle pool
off/on, coalesced unmaps on/off), the operation first runs uninjected on a FaultInjectingBackend, counting the
calls it makes per backend operation. Collection then generates one test per (op, call position n, mode):
"once" fails only the nth call; "persistent" fails the nth and every later call of that op, so that the
rollback itself fails too. Afterwards:

* the armed failure fired, and what escaped is PoolExhausted, BackendError or StateConsistencyError;
* if the group is consistent: the logical state is exactly the state before the operation (failure) or the
  uninjected result (success), every slot is mapped iff a mapped page touches it, mapped pages hold their
  data, zero slots read zeros, and the backend holds exactly the handles the pool and group account for;
* "once" failures always leave the group consistent (their rollback runs uninjected);
* if the group is inconsistent: the operation raised StateConsistencyError and the group refuses work;
* in every case, once the injection is cleared, closing and dropping everything leaves no handle and no
  reservation behind (quarantined handles are released at close).

The session summary ("fault injection" section) prints how many injection points ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from dataplane_helpers import MiB, Rig, expected_live_handles, make_rig
from elastic_kv import _vmm
from elastic_kv.errors import PoolExhausted, StateConsistencyError

OPS = ("reserve", "free_va", "create", "release", "map", "unmap", "set_access", "synchronize")
# Two spaces: space 0 has 4 MiB compound pages (one handle per page), space 1 has 3 MiB pages over 2 MiB
# slots, so neighbouring pages share a slot (reference-counted).
EXTENTS = [(0, 0, 4 * MiB, 4 * MiB), (1, 0, 3 * MiB, 3 * MiB)]
NUM_PAGES = 6
WARM_PAGES = [4, 5]


@dataclass(frozen=True)
class Config:
    name: str
    max_cached_bytes: int
    multi_unmap: bool


CONFIGS = [
    Config("nocache", 0, True),
    Config("nocache-single-unmap", 0, False),
    Config("cached", 64 * MiB, True),
    Config("cached-single-unmap", 64 * MiB, False),
]


def _build(fault: _vmm.FaultInjectingBackend, config: Config) -> Rig:
    rig = make_rig(fault, num_pages=NUM_PAGES, extents=EXTENTS, max_cached_bytes=config.max_cached_bytes)
    rig.check_step = 64 * 1024 + 1  # odd: successive samples land at different offsets within OS pages
    return rig


def _warm(rig: Rig) -> None:
    """With a cache, the pool starts warm (some acquires hit), as in steady state."""
    rig.group.map(WARM_PAGES)
    rig.group.unmap(WARM_PAGES)


def _map_setup(rig: Rig) -> None:
    _warm(rig)
    rig.group.map([1])
    rig.write_page(1)


def _mapped_setup(rig: Rig) -> None:
    _warm(rig)
    rig.group.map([0, 1, 2, 3])
    for p in (0, 1, 2, 3):
        rig.write_page(p)


def _prepared_setup(rig: Rig) -> None:
    _mapped_setup(rig)
    rig.group.prepare(1, [1, 2])
    rig.group.unmap([3])  # the slot pages 2 and 3 share is now held only by the prepared tx


ASYNC_ERRORS = {"PoolExhausted": PoolExhausted, "StateConsistencyError": StateConsistencyError}


def _map_async(rig: Rig) -> None:
    rig.group.map_async([0, 2, 3])
    ((_, _, error),) = rig.group.collect(wait=True)
    if error is not None:
        kind = error.split(":", 1)[0]
        raise ASYNC_ERRORS.get(kind, _vmm.BackendError)(error)


@dataclass(frozen=True)
class Scenario:
    name: str
    setup: Callable[[Rig], None]
    run: Callable[[Rig], None]


SCENARIOS = [
    Scenario("map", _map_setup, lambda r: r.group.map([0, 2, 3])),
    Scenario("unmap", _mapped_setup, lambda r: r.group.unmap([0, 1, 3])),
    Scenario("prepare", _mapped_setup, lambda r: r.group.prepare(1, [1, 2])),
    Scenario("commit", _prepared_setup, lambda r: r.group.commit(1)),
    Scenario("abort", _prepared_setup, lambda r: r.group.abort(1)),
    Scenario("map_async", _map_setup, _map_async),
]


@dataclass(frozen=True)
class Point:
    scenario: str
    config: Config
    op: str
    nth: int
    persistent: bool
    expected_after: tuple[tuple[str, ...], tuple[str | None, ...]] | None = field(default=None, compare=False)

    @property
    def id(self) -> str:
        mode = "persistent" if self.persistent else "once"
        return f"{self.scenario}-{self.config.name}-{self.op}#{self.nth}-{mode}"


def _logical(rig: Rig) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    g = rig.group
    return tuple(g.page_state(p) for p in range(g.num_pages)), (g.tx_state(1),)


def _count_calls(scenario: Scenario | None, config: Config) -> tuple[dict[str, int], object]:
    fault = _vmm.FaultInjectingBackend(_vmm.HostBackend(granularity=2 * MiB, multi_unmap=config.multi_unmap))
    if scenario is None:  # the "create" scenario: building the spaces and the group
        before = {op: fault.calls(op) for op in OPS}
        rig = _build(fault, config)
        counts = {op: fault.calls(op) - before[op] for op in OPS}
        rig.close()
        return counts, None
    rig = _build(fault, config)
    scenario.setup(rig)
    before = {op: fault.calls(op) for op in OPS}
    scenario.run(rig)
    counts = {op: fault.calls(op) - before[op] for op in OPS}
    after = _logical(rig)
    rig.close()
    return counts, after


def _points() -> list[Point]:
    points: list[Point] = []
    for config in CONFIGS:
        for scenario in [None, *SCENARIOS]:
            counts, after = _count_calls(scenario, config)
            name = "create" if scenario is None else scenario.name
            for op in OPS:
                for nth in range(1, counts[op] + 1):
                    for persistent in (False, True):
                        points.append(Point(name, config, op, nth, persistent, after))  # type: ignore[arg-type]
    return points


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "point" in metafunc.fixturenames:
        points = _points()
        metafunc.parametrize("point", points, ids=[p.id for p in points])


def _arm(fault: _vmm.FaultInjectingBackend, point: Point) -> None:
    # The driver reports OOM from cuMemCreate and cuMemMap; everything else fails with a generic error.
    error = "oom" if point.op in ("create", "map") else "error"
    fault.fail(point.op, nth=point.nth, times=-1 if point.persistent else 1, error=error)


def _expected_slots(rig: Rig) -> list[list[str]]:
    slots = [["zero"] * sp.num_slots for sp in rig.spaces]
    for page in rig.group.mapped_pages():
        for space, start, n in rig.group.page_units(page):
            for s in range(start, start + n):
                slots[space][s] = "mapped"
    return slots


def _close(fault: _vmm.FaultInjectingBackend, rig: Rig) -> None:
    """Clears the injection and closes the group: only the pool's handles and the zero pages stay."""
    fault.clear()
    rig.close()
    zero_pages = len({sp.page_size for sp in rig.spaces} | {4 * MiB})  # 2 MiB slots, 4 MiB compound units
    assert fault.live_handles == rig.pool.cached_handles + rig.pool.failed_releases + zero_pages


def _nothing_left(fault: _vmm.FaultInjectingBackend, allow_leak: bool) -> None:
    """Once every object is dropped, no handle and no reservation may remain (unless a cleanup failure was
    counted, which only a persistent injection during construction can cause). Reference counting frees
    the objects; the tests keep no exception (whose traceback would keep them alive)."""
    if allow_leak and fault.cleanup_failures > 0:
        return
    assert fault.live_handles == 0, "a physical handle leaked"
    assert fault.live_reservations == 0, "a reservation leaked"


def _check_create(point: Point, injection_log: list[tuple[str, str, str, str]]) -> None:
    fault = _vmm.FaultInjectingBackend(
        _vmm.HostBackend(granularity=2 * MiB, multi_unmap=point.config.multi_unmap)
    )
    _arm(fault, point)
    rig: Rig | None = None
    outcome = "succeeded"
    try:
        rig = _build(fault, point.config)
    except (PoolExhausted, _vmm.BackendError) as e:
        outcome = type(e).__name__
    except StateConsistencyError:
        assert point.persistent, "a single failure must be rolled back cleanly"
        outcome = "inconsistent"
    assert fault.injected(point.op) >= 1, "the armed failure never fired: the enumeration is stale"
    if rig is not None:  # building survived the failure (e.g. a swallowed cleanup failure): it must work
        fault.clear()
        rig.group.map([0])
        rig.write_page(0)
        assert rig.page_intact(0)
        _close(fault, rig)
        del rig
    fault.clear()
    _nothing_left(fault, allow_leak=point.persistent)
    injection_log.append((point.scenario, point.op, "persistent" if point.persistent else "once", outcome))


def test_injected_failure_is_rolled_back_or_reported(point: Point, injection_log) -> None:
    if point.scenario == "create":
        _check_create(point, injection_log)
        return
    scenario = next(s for s in SCENARIOS if s.name == point.scenario)
    fault = _vmm.FaultInjectingBackend(
        _vmm.HostBackend(granularity=2 * MiB, multi_unmap=point.config.multi_unmap)
    )
    rig = _build(fault, point.config)
    scenario.setup(rig)
    before = _logical(rig)
    mapped_before = rig.group.mapped_pages()
    baseline = fault.live_handles - expected_live_handles(rig, 0)

    _arm(fault, point)
    error: type[Exception] | None = None  # the type only: a kept exception would keep the rig alive
    try:
        scenario.run(rig)
    except (PoolExhausted, _vmm.BackendError, StateConsistencyError) as e:
        error = type(e)
    assert fault.injected(point.op) >= 1, "the armed failure never fired: the enumeration is stale"

    if not rig.group.consistent:
        assert point.persistent, "a single failure must be rolled back cleanly"
        assert error is StateConsistencyError, "an inconsistent group must say so"
        fault.clear()
        with pytest.raises(StateConsistencyError):
            rig.group.map([5])
        outcome = "inconsistent"
    else:
        assert error is not StateConsistencyError
        assert all(sp.consistent for sp in rig.spaces)
        state = _logical(rig)
        if error is None:
            assert state == point.expected_after
            outcome = "succeeded"
        else:
            assert state == before, "a failed operation must leave the logical state unchanged"
            outcome = error.__name__
        assert rig.slot_states() == _expected_slots(rig)
        for page in rig.group.mapped_pages():
            if page in mapped_before:
                assert rig.page_intact(page), f"page {page} lost its data"
        assert rig.zero_slots_read_zero()
        assert fault.live_handles == expected_live_handles(rig, baseline), "handle accounting is off"
        fault.clear()
        if error is not None:  # the same operation succeeds once the fault is gone
            scenario.run(rig)
            assert _logical(rig) == point.expected_after
            for page in rig.group.mapped_pages():
                if page in mapped_before:
                    assert rig.page_intact(page)
    _close(fault, rig)
    del rig
    _nothing_left(fault, allow_leak=False)
    injection_log.append((point.scenario, point.op, "persistent" if point.persistent else "once", outcome))


def test_the_suite_reaches_rollback_failures(injection_log) -> None:
    """Sanity of the suite itself: some persistent failure must hit a rollback (else the suite is too weak).
    Runs a known case directly: map fails persistently at its 2nd map call, and the zero page cannot be
    mapped back either."""
    fault = _vmm.FaultInjectingBackend(_vmm.HostBackend(granularity=2 * MiB))
    rig = _build(fault, CONFIGS[0])
    fault.fail("map", nth=2, times=-1, error="error")
    with pytest.raises(StateConsistencyError):
        rig.group.map([0, 2])
    assert not rig.group.consistent and rig.group.error
    assert any(sp.quarantined_units > 0 for sp in rig.spaces)
    assert any("quarantined" in states for states in rig.slot_states())
    _close(fault, rig)
    del rig
    _nothing_left(fault, allow_leak=False)
