"""Background pre-mapping: map_async/collect, pending pages, failures, interleaving, shutdown."""

from __future__ import annotations

import time

import pytest
from dataplane_helpers import MiB, expected_live_handles, make_rig
from elastic_kv import _vmm

SLOW = 0.05  # seconds per map call on the slowed-down backend
# A background request long enough that the test thread, however loaded the machine, acts while it runs.
LONG_REQUEST = 60


def test_map_async_maps_in_the_background(make_backend) -> None:
    backend = make_backend()
    rig = make_rig(backend, num_pages=16)
    ticket = rig.group.map_async([3, 4, 5])
    results = rig.group.collect(wait=True)
    assert results == [(ticket, [3, 4, 5], None)]
    assert rig.group.mapped_pages() == [3, 4, 5]
    for p in (3, 4, 5):
        rig.write_page(p)
        assert rig.page_intact(p)
    assert rig.group.collect() == []  # results are handed out once
    rig.close()


def test_pending_pages_are_neither_mappable_nor_unmappable_until_done() -> None:
    fault = _vmm.FaultInjectingBackend(_vmm.HostBackend(granularity=2 * MiB))
    rig = make_rig(fault, num_pages=LONG_REQUEST + 4)
    fault.delay("map", SLOW)
    pages = list(range(LONG_REQUEST))
    last = pages[-1]
    ticket = rig.group.map_async(pages)
    assert rig.group.page_state(last) == "pending" and not rig.group.is_mapped(last)
    with pytest.raises(ValueError, match="background"):
        rig.group.map([last])
    with pytest.raises(ValueError, match="background"):
        rig.group.unmap([last])
    other = LONG_REQUEST + 2
    rig.group.map([other])  # foreground work on other pages interleaves with the request
    assert rig.group.is_mapped(other)
    fault.clear()  # the rest of the request needs no slowing down
    assert rig.group.collect(wait=True) == [(ticket, pages, None)]
    assert rig.group.mapped_pages() == [*pages, other]
    fault.clear()
    rig.close()


def test_failed_request_is_rolled_back_and_reported() -> None:
    backend = _vmm.HostBackend(granularity=2 * MiB, physical_budget=2 * MiB + 3 * 2 * MiB)
    rig = make_rig(backend, num_pages=8, max_cached_bytes=0)
    baseline = backend.live_handles
    ticket = rig.group.map_async([0, 1, 2, 3, 4])
    ((got, pages, error),) = rig.group.collect(wait=True)
    assert (got, pages) == (ticket, [0, 1, 2, 3, 4])
    assert error is not None and error.startswith("PoolExhausted:")
    assert rig.group.mapped_pages() == [] and rig.group.consistent  # all or nothing
    assert backend.live_handles == expected_live_handles(rig, baseline)
    rig.group.map_async([0, 1, 2])
    assert rig.group.collect(wait=True)[0][2] is None
    rig.close()


def test_close_cancels_queued_requests_and_joins_the_worker() -> None:
    fault = _vmm.FaultInjectingBackend(_vmm.HostBackend(granularity=2 * MiB))
    rig = make_rig(fault, num_pages=LONG_REQUEST + 4)
    baseline = fault.live_handles
    fault.delay("map", SLOW)
    first = rig.group.map_async(list(range(LONG_REQUEST)))
    second = rig.group.map_async([LONG_REQUEST + 1, LONG_REQUEST + 2])
    time.sleep(SLOW)  # the worker is inside the first request
    started = time.monotonic()
    rig.group.close()
    assert time.monotonic() - started < 20 * SLOW  # it stopped between pages, not after the whole queue
    results = {ticket: error for ticket, _, error in rig.group.collect()}
    assert set(results) == {first, second}
    assert all(error is not None and error.startswith("Cancelled") for error in results.values())
    assert rig.slot_states() == [["zero"] * (LONG_REQUEST + 4)]
    fault.clear()
    assert fault.live_handles == baseline + rig.pool.cached_handles


def test_dropping_a_group_with_work_in_flight_shuts_down_cleanly() -> None:
    fault = _vmm.FaultInjectingBackend(_vmm.HostBackend(granularity=2 * MiB))
    rig = make_rig(fault, num_pages=8, max_cached_bytes=0)
    fault.delay("map", SLOW / 5)
    rig.group.map_async([0, 1, 2, 3, 4, 5, 6, 7])
    group, pool, spaces = rig.group, rig.pool, rig.spaces
    del rig
    del group  # the destructor stops and joins the worker, then releases every handle
    assert fault.live_handles == 1 + pool.cached_handles  # the zero page only
    del spaces, pool
    assert fault.live_handles == 0 and fault.live_reservations == 0
