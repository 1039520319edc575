"""Every bad argument gets ValueError (or its documented type) and leaves the state exactly as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dataplane_helpers import MiB, Rig, make_rig
from elastic_kv import _vmm


def _state(rig: Rig) -> tuple[Any, ...]:
    g = rig.group
    return (
        g.mapped_pages(),
        [g.page_state(p) for p in range(g.num_pages)],
        rig.slot_states(),
        g.mapped_bytes,
        g.held_handles,
        [g.tx_state(t) for t in (1, 2, 3, 4)],
        rig.backend.live_handles,
        rig.backend.live_reservations,
        rig.pool.cached_handles,
        {op: rig.backend.calls(op) for op in ("create", "release", "map", "unmap", "set_access", "reserve")},
        g.consistent,
    )


@pytest.fixture
def rig(make_backend) -> Iterator[Rig]:
    """Pages 0, 1 mapped (with data), page 2 prepared in tx 1, tx 2 committed, tx 3 aborted."""
    r = make_rig(make_backend(), num_pages=8)
    r.group.map([0, 1, 2, 4])
    for p in (0, 1, 2, 4):
        r.write_page(p)
    r.group.prepare(1, [2])
    r.group.prepare(2, [4])
    r.group.commit(2)
    r.group.abort(3)
    yield r
    r.close()


BAD_CALLS: dict[str, Callable[[_vmm.SpaceGroup], object]] = {
    "map page out of range": lambda g: g.map([8]),
    "map negative page": lambda g: g.map([-1]),
    "map duplicate page": lambda g: g.map([5, 5]),
    "double map": lambda g: g.map([5, 0]),
    "map prepared page": lambda g: g.map([2]),
    "unmap unmapped page": lambda g: g.unmap([0, 5]),
    "unmap out of range": lambda g: g.unmap([0, 99]),
    "unmap duplicate page": lambda g: g.unmap([0, 0]),
    "unmap prepared page": lambda g: g.unmap([2]),
    "prepare tx already prepared": lambda g: g.prepare(1, [0]),
    "prepare committed tx": lambda g: g.prepare(2, [0]),
    "prepare aborted tx (late prepare)": lambda g: g.prepare(3, [0]),
    "prepare negative tx": lambda g: g.prepare(-5, [0]),
    "prepare unmapped page": lambda g: g.prepare(4, [0, 6]),
    "commit unknown tx": lambda g: g.commit(4),
    "commit aborted tx": lambda g: g.commit(3),
    "abort committed tx": lambda g: g.abort(2),
    "abort negative tx": lambda g: g.abort(-1),
    "map_async mapped page": lambda g: g.map_async([6, 1]),
    "page_state out of range": lambda g: g.page_state(8),
    "is_mapped negative": lambda g: g.is_mapped(-1),
    "page_units out of range": lambda g: g.page_units(100),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_group_call_raises_value_error_and_changes_nothing(rig: Rig, name: str) -> None:
    before = _state(rig)
    with pytest.raises(ValueError):
        BAD_CALLS[name](rig.group)
    assert _state(rig) == before
    for p in (0, 1):
        assert rig.page_intact(p)


def _group_args(backend: _vmm.Backend) -> dict[str, Any]:
    space = _vmm.TensorSpace(backend, 8 * MiB, 2 * MiB)
    return {
        "spaces": [space],
        "extents": [(0, 0, 2 * MiB, 2 * MiB)],
        "num_pages": 4,
        "pool": _vmm.HandlePool(backend, 0),
        "history": 8,
    }


BAD_GROUPS: dict[str, Callable[[dict[str, Any], _vmm.Backend], None]] = {
    "extent beyond the space": lambda a, b: a.update(extents=[(0, 0, 2 * MiB, 4 * MiB)]),
    "extent base beyond the space": lambda a, b: a.update(extents=[(0, 9 * MiB, 0, MiB)]),
    "extent space index": lambda a, b: a.update(extents=[(1, 0, 2 * MiB, 2 * MiB)]),
    "extent zero length": lambda a, b: a.update(extents=[(0, 0, 2 * MiB, 0)]),
    "extent negative field": lambda a, b: a.update(extents=[(0, -1, 2 * MiB, 2 * MiB)]),
    "no extents": lambda a, b: a.update(extents=[]),
    "no spaces": lambda a, b: a.update(spaces=[]),
    "same space twice": lambda a, b: a.update(spaces=a["spaces"] * 2),
    "zero pages": lambda a, b: a.update(num_pages=0),
    "negative pages": lambda a, b: a.update(num_pages=-1),
    "zero history": lambda a, b: a.update(history=0),
    "pool of another backend": lambda a, b: a.update(pool=_vmm.HandlePool(_vmm.HostBackend(), 0)),
}


@pytest.mark.parametrize("name", sorted(BAD_GROUPS))
def test_bad_group_construction_raises_value_error_and_leaks_nothing(make_backend, name: str) -> None:
    backend = make_backend()
    args = _group_args(backend)
    BAD_GROUPS[name](args, backend)
    before = (backend.live_handles, backend.live_reservations, backend.calls("map"), backend.calls("unmap"))
    with pytest.raises(ValueError):
        _vmm.SpaceGroup(**args)
    assert (
        backend.live_handles,
        backend.live_reservations,
        backend.calls("map"),
        backend.calls("unmap"),
    ) == before
    if args["spaces"]:  # the space was not claimed: a valid group can still take it
        good = _group_args(backend)
        _vmm.SpaceGroup(args["spaces"][:1], good["extents"], 4, good["pool"]).close()


def test_bad_backend_and_injector_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of the OS page size"):
        _vmm.HostBackend(granularity=1000)
    with pytest.raises(ValueError):
        _vmm.HostBackend(physical_budget=-1)
    fault = _vmm.FaultInjectingBackend(_vmm.HostBackend())
    with pytest.raises(ValueError, match="unknown backend operation"):
        fault.fail("mmap")
    with pytest.raises(ValueError):
        fault.fail("map", nth=0)
    with pytest.raises(ValueError):
        fault.fail("map", times=0)
    with pytest.raises(ValueError):
        fault.fail("map", error="segfault")
    with pytest.raises(ValueError):
        fault.calls("nothing")
