"""``CoordinatorMapper``: background maps and releases behind the caller, over real ranks.

Every transport kind (the ``cluster`` fixture). Ranks are slowed or made to fail with the harness's
scripts and data-plane fault injection; after every test the ranks agree, are consistent and leak nothing,
and the mapper's answers say exactly what happened. The last tests drive a real ledger through it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from elastic_kv.config import ElasticConfig
from elastic_kv.errors import StateConsistencyError
from elastic_kv.geometry import BlockFamily, BlockGeometry
from elastic_kv.ledger import Ledger
from elastic_kv.ranks import CoordinatorMapper
from elastic_kv.ranks.messages import Op
from ranks_harness import Cluster

STALL_S = 0.4


@pytest.fixture
def mapper(cluster: Cluster, pool: int) -> Iterator[CoordinatorMapper]:
    m = CoordinatorMapper(cluster.coordinator(pool, timeout=5.0), name="test-mapper")
    try:
        yield m
    finally:
        m.close()


def test_unmap_returns_before_the_release_and_a_later_map_waits_for_it(
    cluster: Cluster, pool: int, mapper: CoordinatorMapper
) -> None:
    mapper.map([1, 2, 3])
    cluster.ctl(0, "script", int(Op.PREPARE), "stall", STALL_S)
    mapper.unmap([2, 3])
    # Returned while rank 0 still stalls in the release, its pages still backed.
    assert mapper.pending_releases == 1
    assert cluster.snapshots(pool)[0][0] == (1, 2, 3)
    mapper.map([3])  # the page just released: waits for the release, then maps it again
    assert mapper.pending_releases == 0
    cluster.assert_agree(pool, [1, 3])
    assert mapper.calls == 2 and mapper.releases == 1


def test_background_maps_run_after_the_releases_queued_before_them(
    cluster: Cluster, pool: int, mapper: CoordinatorMapper
) -> None:
    mapper.map([4, 5])
    cluster.ctl(1, "script", int(Op.PREPARE), "stall", STALL_S)
    mapper.unmap([4, 5])
    job = mapper.map_async([5, 6])
    assert mapper.collect(wait=True) == [(job, [5, 6], None)]
    assert mapper.pending_releases == 0
    cluster.assert_agree(pool, [5, 6])
    # That collect waited for a job; one with nothing queued, or one that does not wait, does not count.
    mapper.collect(wait=True)
    mapper.map_async([7])
    mapper.collect()
    assert mapper.waits == 1


def test_flush_waits_for_every_queued_release(cluster: Cluster, pool: int, mapper: CoordinatorMapper) -> None:
    mapper.map(list(range(8)))
    for page in range(8):
        mapper.unmap([page])
    assert mapper.flush(timeout=30.0)
    assert mapper.pending_releases == 0
    cluster.assert_agree(pool, [])


def test_a_release_that_fails_once_is_retried(cluster: Cluster, pool: int, mapper: CoordinatorMapper) -> None:
    mapper.map([1, 2])
    cluster.ctl(2, "fail", pool, "unmap", 1, 1, "error")  # the data plane's next unmap on rank 2 fails
    mapper.unmap([1, 2])
    assert mapper.flush(timeout=30.0)
    cluster.assert_agree(pool, [])
    mapper.map([2])  # the pool carries on
    cluster.assert_agree(pool, [2])


def test_a_release_that_keeps_failing_stops_the_mapper(
    cluster: Cluster, pool: int, mapper: CoordinatorMapper
) -> None:
    mapper.map([1, 2])
    cluster.ctl(1, "fail", pool, "unmap", 1, 10, "error")
    mapper.unmap([2])
    assert mapper.flush(timeout=30.0)
    # Rolled back on every rank each time: page 2 is still backed, the ranks agree and leak nothing...
    cluster.assert_agree(pool, [1, 2])
    # ... but whoever queued the release believes it happened, so the mapper refuses to go on.
    with pytest.raises(StateConsistencyError, match=r"release of pages \[2\]"):
        mapper.map([3])
    with pytest.raises(StateConsistencyError, match=r"release of pages \[2\]"):
        mapper.unmap([1])
    job = mapper.map_async([4])
    ((done, pages, error),) = mapper.collect(wait=True)
    assert (done, pages) == (job, [4]) and error is not None and error.startswith("StateConsistencyError")
    cluster.ctl(1, "clear", pool)
    cluster.assert_agree(pool, [1, 2])  # nothing was attempted after the failure


class _Gated:
    """The coordinator, with its ``op`` calls after the first ``skip`` waiting at a gate the test opens."""

    def __init__(self, inner: Any, op: str = "unmap", skip: int = 0) -> None:
        self.inner, self.op, self.skip = inner, op, skip
        self.entered, self.gate = threading.Event(), threading.Event()

    def _call(self, op: str, pages: Any) -> None:
        if op == self.op:
            if self.skip:
                self.skip -= 1
            else:
                self.entered.set()
                assert self.gate.wait(30.0)
        getattr(self.inner, op)(pages)

    def map(self, pages: Any) -> None:
        self._call("map", pages)

    def unmap(self, pages: Any) -> None:
        self._call("unmap", pages)


def test_close_drops_queued_jobs_and_finishes_the_one_in_progress(cluster: Cluster, pool: int) -> None:
    gated = _Gated(cluster.coordinator(pool, timeout=5.0))
    mapper = CoordinatorMapper(gated)
    mapper.map([1, 3])
    mapper.unmap([1])
    assert gated.entered.wait(30.0)  # the release of page 1 is in progress
    job = mapper.map_async([2])
    mapper.unmap([3])
    closing = threading.Thread(target=mapper.close)
    closing.start()
    gated.gate.set()
    closing.join(30.0)
    assert mapper.collect(wait=True) == [(job, [2], "Cancelled: the mapper is closing")]
    assert mapper.flush(timeout=0) and mapper.pending_releases == 0
    cluster.assert_agree(pool, [3])  # page 1's release finished; the queued map and release never ran


def test_collect_can_wait_for_the_oldest_jobs_only(cluster: Cluster, pool: int) -> None:
    gated = _Gated(cluster.coordinator(pool, timeout=5.0), op="map", skip=1)
    mapper = CoordinatorMapper(gated)
    try:
        first, second = mapper.map_async([1]), mapper.map_async([2])
        assert gated.entered.wait(30.0)  # the second job is in progress, held at the gate
        assert mapper.collect(wait=True, jobs=1) == [(first, [1], None)]
        assert mapper.waits == 0  # the oldest job had finished: nothing to wait for
        gated.gate.set()
        assert mapper.collect(wait=True) == [(second, [2], None)]
        cluster.assert_agree(pool, [1, 2])
    finally:
        gated.gate.set()
        mapper.close()


# -- a ledger driving the ranks through the mapper --------------------------------------------------------


def _ledger(cluster: Cluster, pool: int, mapper: CoordinatorMapper, **config: int) -> Ledger:
    page = 2 << 20  # the host backend's granularity: the harness's pages, one handle each
    block = page // 4
    geometry = BlockGeometry([16 * page], [BlockFamily(0, 0, block, block)], 64, page, blocks_per_page=4)
    assert geometry.num_pages == 16 and geometry.page_bytes == page
    cfg = ElasticConfig(**{"page_size": page, "reserve_min_pages": 0, "reserve_max_pages": 0, **config})
    return Ledger(geometry, mapper, cfg, null_block=0)


def test_ledger_churn_through_the_mapper_keeps_ranks_and_ledger_in_step(
    cluster: Cluster, pool: int, mapper: CoordinatorMapper
) -> None:
    ledger = _ledger(cluster, pool, mapper)
    held: list[list[int]] = []
    for i in range(40):
        got = ledger.alloc(1 + (i * 7) % 9)
        assert got is not None
        held.append(got)
        if len(held) > 3:
            ledger.free(held.pop(0))  # emptied pages are released behind
    assert mapper.flush(timeout=30.0)
    ledger.settle()
    backed = ledger.mapped_pages()
    cluster.assert_agree(pool, backed)
    for blocks in held:
        ledger.free(blocks)
    assert mapper.flush(timeout=30.0)
    cluster.assert_agree(pool, [0])  # only the null block's page
    assert ledger.snapshot().mapped_bytes == 2 << 20


def test_ledger_becomes_inconsistent_when_a_release_fails_for_good(
    cluster: Cluster, pool: int, mapper: CoordinatorMapper
) -> None:
    ledger = _ledger(cluster, pool, mapper, premap=False)
    blocks = ledger.alloc(8)  # the rest of page 0 and page 1
    assert blocks is not None
    cluster.ctl(0, "fail", pool, "unmap", 1, 10, "error")
    ledger.free(blocks)  # page 1 empties: its release is queued, and fails on rank 0
    assert mapper.flush(timeout=30.0)
    with pytest.raises(StateConsistencyError):
        ledger.alloc(8)  # needs a new page: the mapper refuses, the ledger marks itself inconsistent
    with pytest.raises(StateConsistencyError, match="inconsistent"):
        ledger.alloc(1)
    cluster.ctl(0, "clear", pool)
    cluster.assert_agree(pool)


def test_alloc_waits_only_for_the_background_maps_it_needs(cluster: Cluster, pool: int) -> None:
    gated = _Gated(cluster.coordinator(pool, timeout=5.0), op="map", skip=2)  # the null page, one job
    mapper = CoordinatorMapper(gated)
    opened = threading.Timer(10.0, gated.gate.set)  # (a wait for every job would otherwise hang)
    opened.start()
    try:
        ledger = _ledger(cluster, pool, mapper, reserve_max_pages=8)
        # Requests arrive: two jobs of one page each (page 0 holds 3 free blocks, a page 4).
        assert ledger.expect(3 + 4) == 1 and ledger.expect(3 + 8) == 1
        assert gated.entered.wait(30.0)  # the second job is held at the gate
        got = ledger.alloc(3 + 4)  # needs the first job's page only: takes it while the second is held
        assert got is not None and not gated.gate.is_set()
        assert ledger.snapshot().inflight_pages >= 1  # the second job (and the reserve's refill)
        gated.gate.set()
        ledger.settle()
        cluster.assert_agree(pool, ledger.mapped_pages())
        check = ledger.snapshot()
        assert check.inflight_pages == 0 and (check.reserve_hits, check.reserve_misses) == (1, 0)
    finally:
        opened.cancel()
        gated.gate.set()
        ledger.close()
        mapper.close()
