"""Unmaps fenced behind engine epochs: applied on each rank only after its device work through the epoch
finished, without blocking the coordinator and without a device-wide synchronize."""

from __future__ import annotations

import pytest
from elastic_kv import _vmm
from elastic_kv.errors import PoolExhausted, StateConsistencyError
from elastic_kv.ranks import EpochFence
from ranks_harness import Cluster


def _future_epoch(cluster: Cluster) -> int:
    return max(cluster.ctl(r, "fence") for r in range(cluster.world)) + 10


def _physical(cluster: Cluster, pool: int) -> set[tuple[int, ...]]:
    return {s[0] for s in cluster.snapshots(pool).values()}


def test_unmap_is_queued_until_the_coordinator_reports_the_epoch(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([1, 2])
    epoch = _future_epoch(cluster)
    c.unmap([1], epoch=epoch)  # returns at once
    assert _physical(cluster, pool) == {(1, 2)}  # still backed: queued work may read page 1
    assert [s.mapped_pages for s in c.status()] == [(2,)] * cluster.world  # but no longer the pool's
    assert all(i.queued_unmaps == 1 for i in c.sync())
    c.finish_epoch(epoch - 1)
    assert all(i.queued_unmaps == 1 for i in c.sync())
    c.finish_epoch(epoch)  # piggybacks on the next request
    assert all(i.queued_unmaps == 0 and i.finished_epoch >= epoch for i in c.sync())
    cluster.assert_agree(pool, [2])


def test_unmap_is_applied_when_the_rank_itself_finishes_the_epoch(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([1, 2, 3])
    epoch = _future_epoch(cluster)
    c.unmap([1, 3], epoch=epoch)
    for r in range(cluster.world):
        cluster.ctl(r, "finish_epoch", epoch)  # the engine, in the rank's process
    cluster.assert_agree(pool, [2])  # applied by finish_epoch itself, no message needed


def test_unmap_waits_for_the_recorded_completion(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([4, 5])
    epoch = _future_epoch(cluster)
    for r in range(cluster.world):
        cluster.ctl(r, "record_epoch", epoch)  # e.g. a CUDA event after the step's last kernel
    c.unmap([4], epoch=epoch)
    assert all(i.queued_unmaps == 1 for i in c.sync())
    for r in range(cluster.world):
        cluster.ctl(r, "complete_epoch", epoch)  # the device finished that work
    assert all(i.queued_unmaps == 0 for i in c.sync())
    cluster.assert_agree(pool, [5])


def test_ranks_may_reach_the_epoch_at_different_times(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([1, 2])
    epoch = _future_epoch(cluster)
    cluster.ctl(0, "finish_epoch", epoch)  # rank 0 is ahead: it unmaps at once, the others queue
    c.unmap([2], epoch=epoch)
    assert [i.queued_unmaps for i in c.sync()] == [0] + [1] * (cluster.world - 1)
    assert [s.mapped_pages for s in c.status()] == [(1,)] * cluster.world  # the pool's view agrees
    c.finish_epoch(epoch)
    c.sync()
    cluster.assert_agree(pool, [1])


def test_mapping_a_retiring_page_waits_for_its_epoch_then_reports_busy(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([1])
    epoch = _future_epoch(cluster)
    c.unmap([1], epoch=epoch)
    with pytest.raises(PoolExhausted, match="retiring behind epoch"):
        c.map([1, 2])  # every rank waited (bounded), answered BUSY; nothing was mapped
    assert c.consistent
    assert all(i.queued_unmaps == 1 for i in c.sync())
    c.finish_epoch(epoch)
    c.map([1, 2])  # the queued unmap is applied first, then the map
    cluster.assert_agree(pool, [1, 2])


def test_a_failed_prepare_aborts_queued_and_prepared_ranks_alike(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([1, 2])
    epoch = _future_epoch(cluster)
    cluster.ctl(0, "finish_epoch", epoch)  # rank 0 prepares at once ...
    cluster.ctl(2, "finish_epoch", epoch)  # ... rank 2 too, but fails; rank 1 queues
    cluster.ctl(2, "fail", pool, "unmap", 1, 1, "error")
    with pytest.raises(_vmm.BackendError, match="rank 2 BACKEND"):
        c.unmap([1], epoch=epoch)
    assert all(i.queued_unmaps == 0 for i in c.sync())  # rank 1 dropped its queued unmap
    cluster.assert_agree(pool, [1, 2])


def test_a_queued_unmap_that_fails_when_applied_stops_the_pool(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([1, 2])
    epoch = _future_epoch(cluster)
    c.unmap([1], epoch=epoch)
    cluster.ctl(1, "fail", pool, "unmap", 1, 1, "error")
    c.finish_epoch(epoch)
    with pytest.raises(StateConsistencyError, match="rank 1 reports its pool inconsistent"):
        c.sync()  # rank 1 could not carry out an unmap it had promised: never diverge silently
    with pytest.raises(StateConsistencyError):
        c.map([3])


class _Done:
    def __init__(self, done: bool) -> None:
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_fence_orders_and_bounds() -> None:
    fence = EpochFence()
    assert fence.reached(0) and not fence.reached(1)
    a, b = _Done(False), _Done(False)
    fence.record(1, a)
    fence.record(3, b)
    with pytest.raises(ValueError, match="recorded after"):
        fence.record(2, _Done(True))
    assert not fence.wait(1, 0.01)
    b.done = True  # completions are consulted oldest first: 3 done but 1 not -> nothing reached
    assert not fence.reached(3)
    a.done = True
    assert fence.reached(3) and fence.finished == 3
    fence.finish(2)  # never goes back
    assert fence.finished == 3
    fence.record(2, _Done(False))  # already finished: ignored
    assert fence.reached(3)
    with pytest.raises(ValueError):
        fence.finish(-1)
    fence.interrupt()
    assert not fence.wait(10, 30.0)  # returns at once once interrupted
