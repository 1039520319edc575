"""A lowered limit drains pages: blocks freed on them are withheld, the pages are released once empty.

The scenario the drain exists for: requests keep running, one is preempted to make room, and its blocks
must not be handed to the others (which would keep the page backed and the pool over its limit for as
long as the requests last).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from elastic_kv.config import ElasticConfig
from elastic_kv.snapshot import PoolState

from .ledger_helpers import SLOT, BudgetRecord, Pool, check_invariants, make_pool, small_geometry

PAGE_BYTES = small_geometry().page_bytes


@pytest.fixture
def deferred() -> Iterator[tuple[Pool, BudgetRecord]]:
    """A pool as the vLLM plugin runs it: deferred release, a shared record, publication throttled (so
    that only the publications the drain forces show up)."""
    record = BudgetRecord()
    cfg = ElasticConfig(
        page_size=SLOT, premap=False, reserve_max_pages=2, defer_release=True, publish_interval_s=3600
    )
    pool = make_pool(config=cfg, record=record)
    yield pool, record
    pool.close()


Running = tuple[Pool, BudgetRecord, dict[str, list[int]]]


@pytest.fixture
def running(deferred: tuple[Pool, BudgetRecord]) -> Running:
    """The ``deferred`` pool and its record, with three 'requests' of whole pages: a on pages 0-1 (page 0
    holds the null block), b on 2-3, c on 4."""
    pool, record = deferred
    led = pool.ledger
    reqs = {"a": led.alloc(7), "b": led.alloc(8), "c": led.alloc(4)}
    assert all(v is not None for v in reqs.values())
    return pool, record, {k: v or [] for k, v in reqs.items()}


def _set_limit(record: BudgetRecord, pages: int) -> None:
    """What ``kvctl limit`` does: the pool's limit in its record becomes ``pages`` pages (0: none)."""
    record.limit_bytes, record.limit_changed = pages * PAGE_BYTES, True


def _pages(pool: Pool, blocks: list[int]) -> set[int]:
    return {pool.ledger.geometry.page_of(b) for b in blocks}


def test_a_preempted_requests_blocks_are_not_handed_to_the_others(running: Running) -> None:
    pool, record, reqs = running
    led = pool.ledger
    assert _pages(pool, reqs["c"]) == {4} and _pages(pool, reqs["b"]) == {2, 3}
    on_two = [b for b in reqs["b"] if led.geometry.page_of(b) == 2]
    led.free(on_two[:1])  # b's page 2 has one free block: the partly used page
    reqs["b"].remove(on_two[0])
    _set_limit(record, 4)
    led.maintain()  # kvctl's limit arrives; 5 pages backed: one must go
    assert record.published[-1].state is PoolState.SHRINKING
    assert led.draining_pages() == [2]  # the fewest live blocks (3): the cheapest page to vacate
    # The engine preempts b; its blocks are freed but never reissued: a running request's next block
    # needs page 2 or 3's free blocks, and only page 3's are offered.
    epoch = led.advance_epoch()
    led.free(reqs["b"])
    assert (
        led.page_state(2) == "withheld" and led.page_state(3) == "pending"
    )  # empty, still backed until the step that read it ends
    grown = led.alloc(4)
    assert grown is not None and _pages(pool, grown) == {3}
    assert led.alloc(1) is None  # page 2's blocks are withheld, and nothing new is mapped over the limit
    check_invariants(pool, {*reqs["a"], *reqs["c"], *grown})
    published = len(record.published)
    led.release_through(epoch)
    assert pool.group.mapped_pages() == [0, 1, 3, 4]
    assert led.charged_bytes == record.charged_bytes == 4 * PAGE_BYTES
    # The pool is within its limit: readers learn it at once, not at the next throttled publication.
    assert len(record.published) == published + 1
    snap = record.published[-1]
    assert snap.state is PoolState.ACTIVE and snap.draining_pages == 0
    check_invariants(pool, {*reqs["a"], *reqs["c"], *grown})


def test_lifting_the_limit_mid_drain_puts_the_pages_back_in_service(running: Running) -> None:
    pool, record, reqs = running
    led = pool.ledger
    _set_limit(record, 3)
    led.maintain()
    draining = led.draining_pages()
    assert len(draining) == 2 and 0 not in draining
    led.advance_epoch()
    victim = next(k for k, v in reqs.items() if _pages(pool, v) & set(draining))
    led.free(reqs.pop(victim))  # a draining page empties, withheld until its epoch ends
    withheld = [p for p in draining if led.page_state(p) == "withheld"]
    assert withheld
    _set_limit(record, 0)
    led.maintain()
    assert record.published[-1].state is PoolState.ACTIVE
    assert led.draining_pages() == [] and led.snapshot().draining_pages == 0
    # The withheld page is an ordinary pending page again, its blocks reusable at once.
    assert all(led.page_state(p) == "pending" for p in withheld)
    again = led.alloc(4)
    assert again is not None and _pages(pool, again) <= set(withheld)
    check_invariants(pool, {b for v in reqs.values() for b in v} | set(again))


def test_raising_the_limit_above_the_charge_ends_the_drain(running: Running) -> None:
    pool, _, reqs = running
    led = pool.ledger
    led.resize(4 * PAGE_BYTES)
    assert len(led.draining_pages()) == 1
    led.resize(5 * PAGE_BYTES)  # exactly what is backed: no longer over
    assert led.draining_pages() == [] and not led.over_limit()
    assert led.snapshot().state is PoolState.ACTIVE
    led.free(reqs["c"][:1])
    assert led.alloc(1) is not None  # page 4's freed block is issued again
    led.resize(2 * PAGE_BYTES)  # lowered again, further: three pages drain
    assert len(led.draining_pages()) == 3 and led.snapshot().state is PoolState.SHRINKING
    check_invariants(pool)


def test_a_limit_below_the_null_blocks_page_drains_everything_else() -> None:
    """The ledger follows any limit (kvctl refuses one below a page); the null block's page stays."""
    with make_pool(
        config=ElasticConfig(page_size=SLOT, premap=False, reserve_min_pages=0, reserve_max_pages=0)
    ) as pool:
        led = pool.ledger
        got = led.alloc(11)
        assert got is not None
        led.resize(1)
        assert led.draining_pages() == [1, 2]
        led.free(got)
        assert pool.group.mapped_pages() == [0]
        assert led.over_limit() and led.snapshot().state is PoolState.SHRINKING
        assert led.alloc(1) is not None  # the null block's page still serves its free blocks
        check_invariants(pool)


def test_preemptions_are_counted_in_the_snapshot(deferred: tuple[Pool, BudgetRecord]) -> None:
    pool, record = deferred
    led = pool.ledger
    assert led.snapshot().preemptions == 0
    led.note_preempted()
    led.note_preempted(2)
    assert led.preemptions == 3 == led.snapshot().preemptions
    led.publish()
    assert record.published[-1].preemptions == 3


def test_a_page_queued_twice_while_draining_is_released_once() -> None:
    """Found by the stateful test: under a limit of one page, a draining page emptied by two clears in one
    epoch is queued twice; releasing that epoch unmaps it once, and the pool stays consistent."""
    record = BudgetRecord()
    cfg = ElasticConfig(
        page_size=SLOT, premap=False, defer_release=True, reserve_min_pages=0, reserve_max_pages=0
    )
    with make_pool(small_geometry(48), cfg, record=record, null_block=0) as pool:
        led = pool.ledger
        assert led.alloc(4) is not None
        led.clear()
        assert led.alloc(1) is not None and led.alloc(3) is not None
        led.resize(pool.ledger.geometry.page_bytes)
        led.clear()
        led.release_through(led.epoch)
        check_invariants(pool)
        assert record.charged_bytes == pool.ledger.geometry.page_bytes  # the null block's page
    assert record.charged_bytes == 0


def test_order_by_holders_drains_what_the_first_preemptions_vacate() -> None:
    from elastic_kv.ledger.drain import order_by_holders

    # Requests in preemption order hold pages {3}, {2, 3}, {1, 5}; page 5 is no candidate, page 4 no
    # request holds (cached blocks only). Preempting the first vacates nothing (page 3 keeps a holder);
    # preempting the second then vacates pages 2 and 3; the third, page 1.
    assert order_by_holders([1, 2, 3, 4], [{3}, {2, 3}, {1, 5}]) == [4, 2, 3, 1]
    # Pages one preemption vacates together keep the candidates' order (the drain's preference).
    assert order_by_holders([3, 2, 1, 4], [{3}, {2, 3}, {1, 5}]) == [4, 3, 2, 1]
    # Candidates held by a request not listed are never completed: left to the drain's own order.
    assert order_by_holders([1, 2], [{1}]) == [2, 1]
    assert order_by_holders([7, 8], []) == [7, 8]
