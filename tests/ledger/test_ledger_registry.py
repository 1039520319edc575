"""The ledger with the real shared-memory registry (``elastic_kv.registry``, built on the ``limits`` branch).

Skipped where the registry is not merged yet. Two pools of one device share a GPU-wide budget; ``kvctl``'s
operations (``Registry.set_limit`` / ``request_trim`` / ``set_budget``) reach a pool through ``maintain()``;
the record's charge always equals what the data plane backs; snapshots reach ``kvctl``'s view.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from elastic_kv import registry
from elastic_kv.config import ElasticConfig
from elastic_kv.snapshot import PoolState

from .ledger_helpers import SLOT, Pool, check_invariants, make_pool, small_geometry

PAGE = small_geometry().page_bytes
CFG = ElasticConfig(
    page_size=SLOT, premap=False, reserve_min_pages=0, reserve_max_pages=4, publish_interval_s=0
)


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[tuple[Pool, Pool, Any]]:
    view = registry.Registry(tmp_path)
    view.set_budget("gpu0", 6 * PAGE)
    records = [
        registry.PoolRecord.create(
            name, device="gpu0", engine="test", model="tiny", limit_bytes=0, registry_dir=tmp_path
        )
        for name in ("a", "b")
    ]
    a, b = (make_pool(config=CFG, record=record, name=record.name) for record in records)
    yield a, b, view
    for pool, record in zip((a, b), records, strict=True):
        pool.close()
        assert record.charged_bytes == 0
        record.close()


def test_two_pools_share_the_gpu_budget(pools: tuple[Pool, Pool, Any]) -> None:
    a, b, view = pools
    assert a.ledger.alloc(3 + 3 * 4) is not None  # a: 4 pages
    assert b.ledger.alloc(3 + 1 * 4) is not None  # b: 2 pages -> the budget (6 pages) is spent
    assert b.ledger.alloc(4) is None  # pressure, not a failure
    for pool in (a, b):
        check_invariants(pool)
        record = pool.ledger._phys.record
        assert record is not None and record.charged_bytes == pool.group.mapped_bytes
    # kvctl lowers a's limit: a shrinks as its blocks drain, and b can grow into the freed budget
    view.set_limit("a", 2 * PAGE)
    a.ledger.maintain()
    assert a.ledger.snapshot().state is PoolState.SHRINKING
    live = [blk for blk in range(64) if a.ledger.is_live(blk) and blk != 0]
    a.ledger.free([blk for blk in live if a.ledger.geometry.page_of(blk) >= 2])
    a.ledger.maintain()
    assert a.ledger.snapshot().state is PoolState.ACTIVE and a.group.num_mapped == 2
    b.ledger.maintain()
    assert b.ledger.alloc(8) is not None  # two more pages for b
    info = view.pool("a")
    assert info.snapshot is not None and info.snapshot.mapped_pages == 2 and info.charged_bytes == 2 * PAGE


def test_kvctl_trim_returns_the_reserve(pools: tuple[Pool, Pool, Any]) -> None:
    a, _, view = pools
    blocks = a.ledger.alloc(3 + 2 * 4)
    assert blocks is not None
    a.ledger.free(blocks[3:])
    assert a.ledger.snapshot().reserve_pages == 2
    view.request_trim("a")
    a.ledger.maintain()
    assert a.ledger.snapshot().reserve_pages == 0 and a.group.num_mapped == 1
    assert view.pool("a").charged_bytes == PAGE


@pytest.mark.parametrize("by", ["kvctl", "engine"])
def test_a_trim_holds_until_the_pool_allocates_again(tmp_path: Path, by: str) -> None:
    """A trim returns the pre-mapped reserve; no later maintain() maps it again until the pool allocates.
    ``kvctl``: ``kvctl trim``, applied by the next maintain(). ``engine``: the engine's own ``trim()`` (a
    vLLM engine going to sleep), then a change of the device budget (what ``elastic-kv serve`` does as
    models sleep and wake), which an idle engine applies by calling maintain()."""
    view = registry.Registry(tmp_path)
    record = registry.PoolRecord.create(
        "t", device="gpu0", engine="test", model="tiny", limit_bytes=0, registry_dir=tmp_path
    )
    cfg = ElasticConfig(
        page_size=SLOT, premap=True, reserve_min_pages=2, reserve_max_pages=4, publish_interval_s=60
    )
    pool = make_pool(config=cfg, record=record, name="t")
    try:
        pool.ledger.maintain()
        pool.ledger.settle()  # the background maps land
        assert pool.ledger.snapshot().reserve_pages == 2 and view.pool("t").charged_bytes == 3 * PAGE
        if by == "kvctl":
            view.request_trim("t")
        else:
            pool.ledger.trim()
            pool.ledger.publish()
            view.set_budget("gpu0", 64 * PAGE)
        pool.ledger.maintain()
        assert pool.ledger.snapshot().reserve_pages == 0
        info = view.pool("t")
        assert info.charged_bytes == PAGE  # the null block's page
        # Published at once (despite publish_interval_s): kvctl reads the answer from the record.
        assert info.snapshot is not None and info.snapshot.reserve_pages == 0
        assert pool.ledger.snapshot().inflight_pages == 0
        for _ in range(3):  # idle calls (an idle SGLang scheduler calls every pass) leave it returned
            pool.ledger.maintain()
            pool.ledger.settle()
        assert pool.ledger.snapshot().reserve_pages == 0 and view.pool("t").charged_bytes == PAGE
        block = pool.ledger.alloc(1)  # demand again: the next step refills the reserve
        assert block is not None
        pool.ledger.maintain()
        pool.ledger.settle()
        assert pool.ledger.snapshot().reserve_pages == 2
    finally:
        pool.close()
        record.close()


def test_a_new_pool_waits_for_room_for_its_first_page_instead_of_failing(tmp_path: Path) -> None:
    """A neighbour holds the whole device budget while a pool starts: the pool's first page waits for the
    neighbour to give memory back (``start_wait_s``) instead of failing the engine; with no room in time
    it fails with ``PoolExhausted`` and leaves nothing charged."""
    import threading
    import time

    from elastic_kv.errors import PoolExhausted

    view = registry.Registry(tmp_path)
    view.set_budget("gpu0", 2 * PAGE)
    records = {
        name: registry.PoolRecord.create(
            name, device="gpu0", engine="test", model="tiny", limit_bytes=0, registry_dir=tmp_path
        )
        for name in ("busy", "late", "never")
    }
    # the neighbour keeps no reserve: the pages its requests free go back to the budget
    busy = make_pool(config=replace(CFG, reserve_max_pages=0), record=records["busy"], name="busy")
    blocks = busy.ledger.alloc(3 + 4)  # the null block's page and one more: the budget is spent
    assert blocks is not None and records["busy"].charged_bytes == 2 * PAGE
    with pytest.raises(PoolExhausted):
        make_pool(config=replace(CFG, start_wait_s=0.2), record=records["never"], name="never")
    assert records["never"].charged_bytes == 0

    def give_back() -> None:  # the neighbour's requests end (on its own thread)
        busy.ledger.bind_thread()
        busy.ledger.free(blocks)
        busy.ledger.maintain()

    release = threading.Timer(0.5, give_back)
    release.start()
    t0 = time.monotonic()
    late = make_pool(config=replace(CFG, start_wait_s=30), record=records["late"], name="late")
    waited = time.monotonic() - t0
    release.join()
    assert 0.4 < waited < 10 and records["late"].charged_bytes == PAGE
    busy.ledger.bind_thread()
    for pool in (late, busy):
        pool.close()
    for record in records.values():
        assert record.charged_bytes == 0
        record.close()
