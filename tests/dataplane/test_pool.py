"""HandlePool: reuse of created handles (hits skip create/release), the cap, trim, OOM retry."""

from __future__ import annotations

import pytest
from dataplane_helpers import MiB, expected_live_handles, make_rig
from elastic_kv import _vmm


def test_unmap_map_cycle_reuses_handles_without_create(make_backend) -> None:
    backend = make_backend()
    rig = make_rig(backend, num_pages=8, max_cached_bytes=64 * MiB)
    rig.group.map([0, 1, 2, 3])
    assert (rig.pool.hits, rig.pool.misses) == (0, 4)
    rig.group.unmap([0, 1, 2, 3])
    assert rig.pool.cached_handles == 4 and rig.pool.cached_bytes == 8 * MiB
    creates, releases = backend.calls("create"), backend.calls("release")
    rig.group.map([4, 5, 6, 7])
    assert (rig.pool.hits, rig.pool.misses) == (4, 4)
    assert backend.calls("create") == creates and backend.calls("release") == releases
    rig.write_page(4)
    assert rig.page_intact(4)
    rig.close()


def test_cache_is_capped_and_trim_returns_memory(make_backend) -> None:
    backend = make_backend()
    rig = make_rig(backend, num_pages=8, max_cached_bytes=2 * 2 * MiB)
    baseline = backend.live_handles
    rig.group.map(list(range(6)))
    rig.group.unmap(list(range(6)))
    assert rig.pool.cached_handles == 2  # the rest went back to the driver
    assert backend.live_handles == baseline + 2
    assert rig.pool.trim(2 * MiB) == 2 * MiB
    assert rig.pool.cached_handles == 1 and backend.live_handles == baseline + 1
    rig.pool.max_cached_bytes = 0  # lowering the cap trims
    assert rig.pool.cached_handles == 0 and backend.live_handles == baseline
    rig.close()


def test_oom_trims_cached_handles_of_other_sizes_and_retries(make_backend) -> None:
    # Zero pages (2 MiB and 4 MiB) + 8 MiB of pages fit; group b's 4 MiB handle only fits once the pool
    # gives back the 2 MiB handles group a left cached.
    backend = make_backend(physical_budget=2 * MiB + 4 * MiB + 8 * MiB)
    pool = _vmm.HandlePool(backend, 64 * MiB)
    space_a = _vmm.TensorSpace(backend, 8 * MiB, 2 * MiB)
    space_b = _vmm.TensorSpace(backend, 8 * MiB, 2 * MiB)
    a = _vmm.SpaceGroup([space_a], [(0, 0, 2 * MiB, 2 * MiB)], 4, pool)
    b = _vmm.SpaceGroup([space_b], [(0, 0, 4 * MiB, 4 * MiB)], 2, pool)
    a.map([0, 1, 2, 3])
    a.unmap([0, 1, 2, 3])
    assert pool.cached_bytes == 8 * MiB
    b.map([0])
    assert b.mapped_pages() == [0] and pool.cached_handles == 0
    a.close()
    b.close()


def test_failed_release_is_kept_counted_and_retried(make_backend) -> None:
    fault = _vmm.FaultInjectingBackend(make_backend())
    rig = make_rig(fault, num_pages=4, max_cached_bytes=0)
    baseline = fault.live_handles
    rig.group.map([0, 1])
    fault.fail("release", nth=1, times=1, error="error")
    rig.group.unmap([0, 1])  # commit cannot fail: the handle whose release failed is kept aside
    assert fault.injected("release") == 1
    assert rig.pool.failed_releases == 1 and rig.group.consistent
    assert fault.live_handles == expected_live_handles(rig, baseline) == baseline + 1
    rig.pool.trim()
    assert rig.pool.failed_releases == 0 and fault.live_handles == baseline
    rig.close()


def test_pool_arguments() -> None:
    with pytest.raises(ValueError):
        _vmm.HandlePool(_vmm.HostBackend(), -1)
