"""Ledger over the real host data plane: allocation, free, epochs, reserve, limits, failures."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.errors import StateConsistencyError
from elastic_kv.snapshot import PoolSnapshot, PoolState

from .ledger_helpers import (
    SLOT,
    BudgetRecord,
    Pool,
    check_invariants,
    fingerprint,
    make_pool,
    small_geometry,
    straddling_geometry,
)

PAGE_BYTES = small_geometry().page_bytes  # 2 layers x one 64 KiB slot


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = make_pool()
    yield p
    p.close()


def fill_pages(pool: Pool, pages: int) -> list[list[int]]:
    """Allocate whole pages one at a time (page 0 holds the null block, so it gets 3)."""
    return [pool.ledger.alloc(4 if i else 3) or [] for i in range(pages)]


def test_alloc_returns_exact_distinct_live_ids_on_backed_pages(pool: Pool) -> None:
    led = pool.ledger
    got = led.alloc(10)
    assert got is not None and len(got) == 10 == len(set(got))
    assert 0 not in got  # the null block is never issued
    assert all(led.is_live(b) for b in got)
    assert led.used_blocks == 10
    check_invariants(pool, set(got))
    assert sorted(pool.group.mapped_pages()) == [0, 1, 2]  # 3 + 4 + 3 blocks: page-affine
    assert led.alloc(0) == []
    with pytest.raises(ValueError):
        led.alloc(-1)


def test_alloc_more_than_exists_takes_nothing(pool: Pool) -> None:
    pool.ledger.alloc(5)
    before = fingerprint(pool)
    assert pool.ledger.alloc(64) is None  # 63 blocks exist beside the null block, 5 are taken
    assert fingerprint(pool) == before


def test_best_fit_then_emptiest(pool: Pool) -> None:
    led = pool.ledger
    pages = fill_pages(pool, 4)  # pages 0..3 full
    led.free(pages[1][:2])  # page 1: 2 free
    led.free(pages[2][:1])  # page 2: 1 free
    led.free(pages[3][:3])  # page 3: 3 free
    got = led.alloc(2)
    assert got is not None and {led.geometry.page_of(b) for b in got} == {1}  # smallest page holding 2
    got = led.alloc(1)
    assert got is not None and {led.geometry.page_of(b) for b in got} == {2}  # exact fit beats page 3
    got = led.alloc(4)  # no partial page holds 4: the emptiest (page 3, 3 free) first, then a new page
    assert got is not None and [led.geometry.page_of(b) for b in got][:3] == [3, 3, 3]
    assert pool.group.mapped_pages() == [0, 1, 2, 3, 4]
    check_invariants(pool)


@pytest.mark.parametrize(
    "bad",
    [[-1], [64], [7], [0], [5, 5], [5, 7], [True], [5.0], ["5"], [5, 6, 10**9]],
    ids=[
        "negative",
        "past-end",
        "never-issued",
        "null",
        "repeated",
        "second-not-live",
        "bool",
        "float",
        "str",
        "late",
    ],
)
def test_free_rejects_bad_ids_and_changes_nothing(pool: Pool, bad: list[object]) -> None:
    assert pool.ledger.alloc(6) is not None  # blocks 1..6 live, 7 not
    before = fingerprint(pool)
    with pytest.raises(ValueError):
        pool.ledger.free(bad)  # type: ignore[arg-type]
    assert fingerprint(pool) == before


def test_double_free_is_rejected(pool: Pool) -> None:
    got = pool.ledger.alloc(3)
    assert got is not None
    pool.ledger.free(got)
    before = fingerprint(pool)
    with pytest.raises(ValueError, match="not live"):
        pool.ledger.free(got[:1])
    assert fingerprint(pool) == before


def test_ids_of_another_pool_are_rejected(pool: Pool) -> None:
    other = make_pool()
    try:
        theirs = other.ledger.alloc(9)
        assert theirs is not None
        pool.ledger.alloc(2)
        before = fingerprint(pool)
        with pytest.raises(ValueError):
            pool.ledger.free(theirs)
        assert fingerprint(pool) == before
    finally:
        other.close()


def test_emptied_pages_fill_the_reserve_up_to_its_cap_then_unmap() -> None:
    with make_pool(
        config=ElasticConfig(page_size=SLOT, premap=False, reserve_min_pages=0, reserve_max_pages=2)
    ) as pool:
        led = pool.ledger
        pages = fill_pages(pool, 6)
        assert pool.group.num_mapped == 6
        for blocks in pages[1:]:
            led.free(blocks)
        assert [led.page_state(p) for p in range(6)] == ["used"] + ["reserve"] * 2 + ["unmapped"] * 3
        assert pool.group.mapped_pages() == [0, 1, 2]
        check_invariants(pool, set(pages[0]))
        with pytest.raises(ValueError, match="keep"):
            led.trim(keep=-1)
        assert led.trim(keep=1) == 1  # the oldest goes first: page 1 emptied before page 2
        assert pool.group.mapped_pages() == [0, 2] and led.page_state(2) == "reserve"
        assert led.trim(keep=1) == 0
        assert led.trim() == 1
        assert pool.group.mapped_pages() == [0]
        assert led.charged_bytes == pool.group.mapped_bytes == PAGE_BYTES
        check_invariants(pool, set(pages[0]))


def test_reserve_pages_are_used_without_mapping() -> None:
    with make_pool(config=ElasticConfig(page_size=SLOT, premap=False, reserve_max_pages=4)) as pool:
        led = pool.ledger
        blocks = led.alloc(7)  # pages 0, 1
        assert blocks is not None
        led.free(blocks[3:])  # page 1 empties into the reserve
        maps = pool.backend.calls("map")
        again = led.alloc(4)
        assert again is not None and {led.geometry.page_of(b) for b in again} == {1}
        assert pool.backend.calls("map") == maps  # no driver call
        assert led.snapshot().reserve_hits == 1


def test_deferred_release_waits_for_its_epoch() -> None:
    cfg = ElasticConfig(
        page_size=SLOT, premap=False, defer_release=True, reserve_min_pages=0, reserve_max_pages=0
    )
    with make_pool(config=cfg) as pool:
        led = pool.ledger
        pages = fill_pages(pool, 4)
        e1 = led.advance_epoch()
        led.free(pages[1])  # empties in epoch e1
        e2 = led.advance_epoch()
        led.free(pages[2])  # empties in epoch e2
        assert led.page_state(1) == led.page_state(2) == "pending"
        assert pool.group.mapped_pages() == [0, 1, 2, 3]  # still backed: the GPU may still use them
        assert led.snapshot().pending_pages == 2
        assert led.release_through(e1 - 1) == 0
        assert led.release_through(e1) == 1
        assert pool.group.mapped_pages() == [0, 2, 3]
        # a pending page can be reused at once (reuse is safe, only unmapping must wait) ...
        maps = pool.backend.calls("map")
        reused = led.alloc(4)
        assert reused is not None and {led.geometry.page_of(b) for b in reused} == {2}
        assert pool.backend.calls("map") == maps
        # ... and its stale queue entry does not release it later
        assert led.release_through(e2) == 0
        assert led.page_state(2) == "used"
        led.free(reused)  # empties again, in epoch e2: pending until e2 is released again
        assert led.page_state(2) == "pending"
        assert led.release_through(e2) == 1
        assert pool.group.mapped_pages() == [0, 3]
        check_invariants(pool, set(pages[0]) | set(pages[3]))


def test_null_block_is_backed_for_life_and_never_issued(pool: Pool) -> None:
    led = pool.ledger
    assert led.null_block == 0 and led.is_live(0)
    assert pool.group.mapped_pages() == [0]
    everything = led.alloc(63)
    assert everything is not None and 0 not in everything
    assert led.alloc(1) is None
    led.clear()
    assert pool.group.mapped_pages() == [0] and led.used_blocks == 0 and led.is_live(0)
    assert led.available_size() == 63


def test_no_null_block_issues_block_zero() -> None:
    with make_pool(null_block=None) as pool:
        assert pool.group.num_mapped == 0
        got = pool.ledger.alloc(64)
        assert got is not None and sorted(got) == list(range(64))
        pool.ledger.free(got)
        assert pool.ledger.used_blocks == 0


def test_available_size_follows_limit_and_cached_free_memory() -> None:
    calls = []
    free_memory = [5 * PAGE_BYTES]

    def physical_free() -> int:
        calls.append(1)
        return free_memory[0]

    clock = [0.0]
    cfg = ElasticConfig(page_size=SLOT, premap=False, limit_bytes=8 * PAGE_BYTES, free_memory_ttl_s=1.0)
    with make_pool(config=cfg, physical_free=physical_free, clock=lambda: clock[0]) as pool:
        led = pool.ledger
        assert len(calls) == 1
        # page 0 backed (3 free) + 5 pages of driver memory (below the 7 pages the limit leaves)
        assert led.available_size() == 3 + 5 * 4
        got = led.alloc(7)  # backs page 1: the cached reading is corrected by our own charge
        assert got is not None
        assert led.available_size() == 4 * 4  # page 1 full; 4 pages of driver memory left
        assert len(calls) == 1  # alloc and available_size never ask the driver
        free_memory[0] = 100 * PAGE_BYTES
        led.maintain()
        assert len(calls) == 1  # the reading is younger than free_memory_ttl_s
        clock[0] = 2.0
        led.maintain()
        assert len(calls) == 2
        assert led.available_size() == 6 * 4  # now the limit binds: 8 pages in all, 2 backed
        assert led.alloc(25) is None
        assert led.alloc(24) is not None


def test_lowering_the_limit_drains_the_pages_with_fewest_live_blocks() -> None:
    cfg = ElasticConfig(page_size=SLOT, premap=False, reserve_max_pages=4)
    with make_pool(config=cfg) as pool:
        led = pool.ledger
        pages = fill_pages(pool, 6)
        led.free(pages[5])  # page 5 -> reserve
        led.free(pages[2][:3])  # page 2: 1 live block left
        led.free(pages[4][:1])  # page 4: 3 live blocks left
        assert pool.group.num_mapped == 6
        led.resize(3 * PAGE_BYTES)
        snap = led.snapshot()
        assert snap.state is PoolState.SHRINKING and snap.reserve_pages == 0
        assert pool.group.mapped_pages() == [0, 1, 2, 3, 4]  # reserve returned now, live pages kept
        # 5 pages backed, 3 allowed: the two with the fewest live blocks drain (page 0 holds the null block)
        assert led.draining_pages() == [2, 4] and snap.draining_pages == 2
        # Their free blocks (3 on page 2, 1 on page 4) are never issued again, and nothing new is mapped.
        assert led.available_size() == led.free_backed_blocks == 0
        assert led.alloc(1) is None
        check_invariants(
            pool, {b for p in (pages[0], pages[1], pages[3]) for b in p} | {*pages[2][3:], *pages[4][1:]}
        )
        led.free(pages[2][3:])  # page 2 empties: unmapped at once (no defer_release)
        assert pool.group.mapped_pages() == [0, 1, 3, 4]
        assert led.snapshot().state is PoolState.SHRINKING
        led.free(pages[4][1:])
        assert pool.group.mapped_pages() == [0, 1, 3]
        snap = led.snapshot()
        assert snap.state is PoolState.ACTIVE and snap.draining_pages == 0 and led.draining_pages() == []
        check_invariants(pool, {b for p in (pages[0], pages[1], pages[3]) for b in p})
        led.resize(0)  # no limit: grows at once
        assert led.alloc(12) is not None
        assert pool.group.num_mapped == 6


def test_clear_frees_everything_but_the_null_block(pool: Pool) -> None:
    pool.ledger.alloc(30)
    pool.ledger.clear()
    assert pool.ledger.used_blocks == 0
    assert pool.group.mapped_pages() == [0]
    check_invariants(pool, set())


def test_out_of_memory_in_the_data_plane_leaves_everything_unchanged() -> None:
    with make_pool(fault=True) as pool:
        led = pool.ledger
        led.alloc(2)
        before = fingerprint(pool)
        pool.backend.fail("create", nth=2, error="oom")  # the second handle of a 2-layer page
        assert led.alloc(6) is None
        assert pool.backend.injected("create") == 1
        assert fingerprint(pool) == before
        assert led.alloc(6) is not None  # pressure passed: works again
        check_invariants(pool)


def test_driver_error_propagates_with_nothing_changed() -> None:
    with make_pool(fault=True) as pool:
        before = fingerprint(pool)
        pool.backend.fail("map", error="error")
        with pytest.raises(_vmm.BackendError):
            pool.ledger.alloc(4)
        assert fingerprint(pool) == before
        assert pool.ledger.alloc(4) is not None


def test_failed_unmap_keeps_the_page_backed_and_retries() -> None:
    cfg = ElasticConfig(page_size=SLOT, premap=False, reserve_min_pages=0, reserve_max_pages=0)
    with make_pool(config=cfg, fault=True) as pool:
        led = pool.ledger
        got = led.alloc(7)
        assert got is not None
        pool.backend.fail("unmap", error="error")
        led.free(got[3:])  # page 1 empties; its unmap fails and is rolled back by the data plane
        assert led.page_state(1) == "reserve" and pool.group.is_mapped(1)
        check_invariants(pool, set(got[:3]))
        led.maintain()  # the reserve is over its target: unmapped now
        assert not pool.group.is_mapped(1)
        check_invariants(pool, set(got[:3]))


def test_failed_rollback_marks_the_pool_inconsistent() -> None:
    pool = make_pool(fault=True)
    try:
        # the second layer's slot fails to map, and so does every map of the rollback (zero page back)
        pool.backend.fail("map", nth=2, times=-1, error="error")
        with pytest.raises(StateConsistencyError):
            pool.ledger.alloc(4)
        assert pool.ledger.snapshot().state is PoolState.INCONSISTENT
        with pytest.raises(StateConsistencyError):
            pool.ledger.alloc(1)
        with pytest.raises(StateConsistencyError):
            pool.ledger.free([1])
    finally:
        pool.backend.clear()
        pool.ledger.close()


def settle(pool: Pool) -> None:
    """One engine step (``maintain()``), then wait for the background maps queued so far and take them in
    (``Ledger.settle``). Exactly one step, however long the maps take: the reserve's sizing counts steps
    (an expectation is forgotten after ``reserve_window`` of them), so the pool's state after this does not
    depend on the machine's speed."""
    pool.ledger.maintain()
    pool.ledger.settle()


@contextlib.contextmanager
def _premapped_pool(**reserve: int) -> Iterator[Pool]:
    """A pool over ``small_geometry(256)`` that maps its reserve in the background (``reserve``: the
    reserve's settings), settled, and closed afterwards."""
    with make_pool(small_geometry(256), config=ElasticConfig(page_size=SLOT, premap=True, **reserve)) as pool:
        settle(pool)
        yield pool


def test_background_premap_serves_allocations_without_driver_calls() -> None:
    cfg = ElasticConfig(page_size=SLOT, premap=True, reserve_min_pages=2, reserve_max_pages=8)
    with make_pool(config=cfg) as pool:
        led = pool.ledger
        led.maintain()  # queues 2 pages on the data plane's thread
        assert led.snapshot().inflight_pages == 2
        settle(pool)
        assert led.snapshot().reserve_pages == 2
        check_invariants(pool)
        maps = pool.backend.calls("map")
        got = led.alloc(3 + 4 + 4)  # page 0's free blocks, then both reserve pages
        assert got is not None
        snap = led.snapshot()
        assert (snap.reserve_hits, snap.reserve_misses) == (2, 0) and led.reserve_hit_rate == 1.0
        # the allocating thread made no driver call: maps since are the background refill (2 pages x 2 layers)
        settle(pool)
        assert pool.backend.calls("map") - maps == 4
        assert led.snapshot().reserve_pages == 2
        check_invariants(pool, set(got))


def test_expected_demand_is_mapped_ahead_and_kept_until_used() -> None:
    with _premapped_pool(reserve_min_pages=0, reserve_max_pages=8) as pool:
        led = pool.ledger
        assert led.snapshot().reserve_pages == 0 and led.free_backed_blocks == 3  # page 0: the null block's
        assert led.expect(3) == 0  # page 0's free blocks hold it
        assert led.expect(3 + 12) == 3  # three more pages, queued at once, one job each ...
        assert led.snapshot().inflight_pages == 3 and len(led._book.inflight) == 3
        assert led.expect(3 + 12) == 0  # ... and not again
        settle(pool)  # the engine's next step: maintain() keeps them for the demand it was told of
        assert led.snapshot().reserve_pages == 3
        got = led.alloc(15)
        assert got is not None
        snap = led.snapshot()
        # Every page came from the reserve, none mapped or waited for on the alloc (a miss would be one).
        # The driver's call count cannot show it: the refill the alloc queues maps on the background thread.
        assert (snap.reserve_hits, snap.reserve_misses) == (3, 0)
        check_invariants(pool, set(got))
        led.free(got)
        window = ElasticConfig().reserve_window  # the pool's: the default
        for _ in range(window + 1):  # an expectation is forgotten like a burst
            led.maintain()
        assert led.snapshot().reserve_pages == 0
        check_invariants(pool)


def test_expected_demand_is_bounded_like_the_reserve() -> None:
    with _premapped_pool(reserve_min_pages=0, reserve_max_pages=4) as pool:
        led = pool.ledger
        assert led.expect(10_000) == 4  # at most reserve_max_pages pages in flight and in the reserve
        settle(pool)
        assert led.snapshot().reserve_pages == 4 and led.expect(10_000) == 0
        led.clear()  # the reserve goes ...
        led.resize(led.charged_bytes)  # ... and a limit at what is left backed allows no page more
        assert led.expect(10_000) == 0 and led.snapshot().inflight_pages == 0
        with pytest.raises(ValueError, match="cannot expect -1 blocks"):
            led.expect(-1)
        check_invariants(pool)


def test_expect_does_nothing_without_premap_and_refuses_other_threads() -> None:
    with make_pool(config=ElasticConfig(page_size=SLOT, premap=False)) as pool:
        assert pool.ledger.expect(100) == 0 and pool.ledger.snapshot().inflight_pages == 0
        errors: list[BaseException] = []

        def other() -> None:
            try:
                pool.ledger.expect(100)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
        check_invariants(pool)


def test_alloc_waits_for_pages_still_in_flight() -> None:
    cfg = ElasticConfig(page_size=SLOT, premap=True, reserve_min_pages=3, reserve_max_pages=8)
    with make_pool(config=cfg, fault=True) as pool:
        led = pool.ledger
        pool.backend.delay("map", 0.01)  # a slow driver: the background maps are still running ...
        led.maintain()  # ... queued here (pages 1-3)
        got = led.alloc(3 + 3 * 4)  # page 0's free blocks and the three queued pages: alloc waits for them
        assert got is not None
        assert {led.geometry.page_of(b) for b in got} == {0, 1, 2, 3}
        snap = led.snapshot()
        assert (snap.reserve_hits, snap.reserve_misses) == (0, 3)  # waited for: misses
        assert pool.group.mapped_pages()[:4] == [0, 1, 2, 3]
        pool.backend.clear()
        settle(pool)
        check_invariants(pool, set(got))


def test_growth_ramp_is_served_from_the_reserve() -> None:
    with _premapped_pool(reserve_min_pages=2, reserve_max_pages=8) as pool:
        led = pool.ledger
        for _ in range(40):  # one new page per engine step
            assert led.alloc(4) is not None
            led.maintain()
            led.settle()  # the step's GPU time: the background maps queued in it have landed
        snap = led.snapshot()
        assert snap.reserve_misses == 0 and snap.reserve_hits >= 39


def test_steady_state_allocations_hit_the_reserve() -> None:
    cfg = ElasticConfig(page_size=SLOT, premap=True, reserve_min_pages=2, reserve_max_pages=8)
    with make_pool(small_geometry(256), config=cfg) as pool:
        led = pool.ledger
        live: list[list[int]] = []
        for step in range(400):
            got = led.alloc(4)  # a request of one page arrives ...
            assert got is not None
            live.append(got)
            if len(live) > 10:  # ... and an old one finishes
                led.free(live.pop(0))
            led.maintain()
            if step == 20:
                warm = led.snapshot()
        end = led.snapshot()
        assert end.reserve_misses == warm.reserve_misses, "steady-state alloc waited for the driver"
        assert end.reserve_hits > warm.reserve_hits
        check_invariants(pool)


def _prefill_then_decode(light: bool) -> tuple[list[int], list[int], int]:
    """A heavy step takes 6 pages (the reserve is refilled to 6), then 8 decode steps take a page each
    (``maintain(light=light)``). Returns the reserve after each decode step, the pages mapped during
    each, and the reserve after 8 more decode steps without allocations."""
    with _premapped_pool(reserve_min_pages=1, reserve_max_pages=8, reserve_window=6) as pool:
        led = pool.ledger
        live = [led.alloc(3), led.alloc(6 * 4)]  # page 0's free blocks, then 6 new pages at once
        led.settle()
        led.maintain()  # the heavy step's housekeeping: refill to 6
        led.settle()
        assert led.snapshot().reserve_pages == 6
        misses = led.snapshot().reserve_misses  # the heavy step mapped its pages synchronously
        reserve, mapped = [], []
        for _ in range(8):
            before = pool.backend.calls("map")
            live.append(led.alloc(4))
            led.maintain(light=light)
            led.settle()
            reserve.append(led.snapshot().reserve_pages)
            mapped.append((pool.backend.calls("map") - before) // 2)  # 2 layers: 2 map calls a page
            assert led.snapshot().reserve_misses == misses  # no decode step waits for the driver
        for _ in range(8):
            led.maintain(light=light)
            led.settle()
        check_invariants(pool, {b for blocks in live for b in blocks or []})
        return reserve, mapped, led.snapshot().reserve_pages


def test_light_steps_use_the_reserve_up_instead_of_refilling_it_beside_them() -> None:
    # Heavy maintenance refills what each step took and, once the heavy step leaves the 6-step window,
    # trims the reserve back to the decode steps' demand.
    reserve, mapped, after = _prefill_then_decode(light=False)
    assert mapped[:3] == [1, 1, 1] and after == 1
    # Light maintenance maps nothing while the reserve holds more than the light steps take (1 page a
    # step, the minimum 1), and trims nothing: the decode steps use up what the heavy step left. (The
    # first decode step's allocation still refills as the heavy step did: maintain() sets the mode.)
    reserve, mapped, after = _prefill_then_decode(light=True)
    assert reserve[:6] == [6, 5, 4, 3, 2, 1] and mapped[:6] == [1, 0, 0, 0, 0, 0]
    assert min(reserve) >= 1  # then refilled at the light target: no allocation waits (checked above)
    assert after == 1


def test_light_steps_trim_the_reserve_above_its_cap() -> None:
    # A step's refill is in flight when its pages come back empty: the reserve fills to the cap from the
    # freed pages, then the background maps land on top of it. Light steps keep what heavy steps left,
    # but not above reserve_max_pages.
    with _premapped_pool(reserve_min_pages=1, reserve_max_pages=4, reserve_window=8) as pool:
        led = pool.ledger
        live = led.alloc(3)
        taken = led.alloc(4 * 4)
        assert taken is not None and led.snapshot().inflight_pages == 4
        led.free(taken)
        led.settle()
        assert led.snapshot().reserve_pages == 8  # above the cap until the next maintain
        led.maintain(light=True)
        assert led.snapshot().reserve_pages == 4
        led.maintain(light=True)  # at the cap and above the light target: kept
        assert led.snapshot().reserve_pages == 4
        check_invariants(pool, set(live or []))


def test_light_steps_still_trim_over_the_limit() -> None:
    with _premapped_pool(reserve_min_pages=4, reserve_max_pages=8) as pool:
        led = pool.ledger
        assert led.snapshot().reserve_pages == 4
        led.resize(PAGE_BYTES)  # kvctl lowered the limit to the null page: the reserve goes at once
        for _ in range(3):
            led.maintain(light=True)
            led.settle()
            assert led.snapshot().reserve_pages == 0  # not refilled to the light target while over
        check_invariants(pool)


def test_record_is_charged_exactly_what_is_backed() -> None:
    record = BudgetRecord()
    geo = straddling_geometry()
    with make_pool(
        geo, ElasticConfig(page_size=SLOT, premap=False, reserve_max_pages=1), record=record
    ) as pool:
        led = pool.ledger
        got = [led.alloc(n) for n in (1, 2, 3, 1, 5)]
        assert record.charged_bytes == led.charged_bytes == pool.group.mapped_bytes
        for blocks in got:
            assert blocks is not None
            led.free(blocks)
            assert record.charged_bytes == pool.group.mapped_bytes
        led.trim()
        assert record.charged_bytes == pool.group.mapped_bytes == geo.exclusive_bytes([0], lambda p: False)
        assert {op for op, _ in record.samples} == {"map", "unmap"}
    assert record.charged_bytes == 0


def test_budget_refusal_is_pressure_not_failure() -> None:
    record = BudgetRecord(budget=[3 * PAGE_BYTES, 0])
    with make_pool(record=record) as pool:
        led = pool.ledger
        assert led.alloc(11) is not None  # 3 pages
        before = fingerprint(pool)
        assert led.alloc(1) is None
        assert fingerprint(pool) == before


@pytest.mark.parametrize("premap", [False, True])
def test_record_error_propagates_with_nothing_changed(premap: bool) -> None:
    record = BudgetRecord()
    cfg = ElasticConfig(page_size=SLOT, premap=premap, reserve_min_pages=2)
    with make_pool(config=cfg, record=record) as pool:
        led = pool.ledger
        before = fingerprint(pool)
        if premap:
            record.fail_next = StateConsistencyError("the record's device slot belongs to another pool")
            with pytest.raises(StateConsistencyError):
                led.maintain()  # refilling the reserve charges the record
            assert fingerprint(pool) == before
        record.fail_next = StateConsistencyError("the record's device slot belongs to another pool")
        with pytest.raises(StateConsistencyError):
            led.alloc(4)  # needs a new page
        assert fingerprint(pool) == before
        assert record.charged_bytes == led.charged_bytes == pool.group.mapped_bytes


def test_kvctl_limit_and_trim_arrive_through_poll() -> None:
    record = BudgetRecord()
    cfg = ElasticConfig(page_size=SLOT, premap=False, reserve_max_pages=4, publish_interval_s=0)
    with make_pool(config=cfg, record=record) as pool:
        led = pool.ledger
        pages = fill_pages(pool, 4)
        led.free(pages[3])
        assert led.snapshot().reserve_pages == 1
        record.trim_requested = True
        led.maintain()
        assert led.snapshot().reserve_pages == 0
        record.limit_bytes, record.limit_changed = 2 * PAGE_BYTES, True
        led.maintain()
        snap = record.published[-1]
        assert isinstance(snap, PoolSnapshot)
        assert snap.state is PoolState.SHRINKING and snap.limit_bytes == 2 * PAGE_BYTES


def test_snapshot_counts() -> None:
    with make_pool() as pool:
        led = pool.ledger
        led.alloc(9)
        snap = led.snapshot()
        assert (snap.total_blocks, snap.used_blocks, snap.free_blocks) == (64, 9, 54)
        assert (snap.total_pages, snap.mapped_pages, snap.blocks_per_page) == (16, 3, 4)
        assert snap.mapped_bytes == 3 * PAGE_BYTES == pool.group.mapped_bytes
        assert PoolSnapshot.from_dict(snap.as_dict()) == snap


def test_closed_pool_refuses_work_and_returns_everything() -> None:
    record = BudgetRecord()
    pool = make_pool(record=record)
    pool.ledger.alloc(20)
    pool.ledger.close()
    assert pool.group.num_mapped == 0 and record.charged_bytes == 0
    with pytest.raises(ValueError, match="closed"):
        pool.ledger.alloc(1)
    pool.ledger.close()  # idempotent
    pool.mapper.close()
