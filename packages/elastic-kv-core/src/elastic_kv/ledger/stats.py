"""What a pool publishes about itself: :func:`pool_snapshot`, from its ledger's parts.

The snapshot is read by ``kvctl``, the Prometheus collector and the engines' own statistics; building it
only reads (under the GIL), so any thread may call it and sees numbers at most one operation old.
"""

from __future__ import annotations

import time

from elastic_kv.ledger.guard import PoolGuard
from elastic_kv.ledger.page_book import PageBook
from elastic_kv.ledger.physical import PhysicalAccount
from elastic_kv.snapshot import PoolSnapshot, PoolState

__all__ = ["pool_snapshot"]


def pool_snapshot(
    guard: PoolGuard,
    book: PageBook,
    phys: PhysicalAccount,
    *,
    has_null: bool,
    available_blocks: int,
    hits: int,
    misses: int,
    epoch: int,
    preemptions: int,
    largest_request_bytes: int = 0,
    failed_requests: int = 0,
) -> PoolSnapshot:
    """The statistics of the pool ``guard.name`` now (``has_null``: the pool holds a null block, which
    counts as neither used nor free; ``preemptions``: requests the engine preempted;
    ``largest_request_bytes``: what its largest request needs; ``failed_requests``: requests the engine
    ended because they need more than the pool's ceiling)."""
    if guard.closed:
        state = PoolState.CLOSED
    elif guard.broken is not None:
        state = PoolState.INCONSISTENT
    elif phys.over_limit():
        state = PoolState.SHRINKING
    else:
        state = PoolState.ACTIVE
    geo, live = book.geo, book.live_count()
    return PoolSnapshot(
        name=guard.name,
        state=state,
        block_size_bytes=geo.block_bytes,
        page_size=geo.page_size,
        page_bytes=geo.page_bytes,
        blocks_per_page=book.bpp,
        total_blocks=book.nb,
        used_blocks=live - has_null,
        free_blocks=book.nb - live,
        available_blocks=available_blocks,
        total_pages=book.npages,
        mapped_pages=book.npages - len(book.unmapped) - book.inflight_pages,
        reserve_pages=len(book.reserve),
        pending_pages=len(book.pending_epoch),
        inflight_pages=book.inflight_pages,
        mapped_bytes=phys.charged,
        limit_bytes=phys.limit,
        reserve_hits=hits,
        reserve_misses=misses,
        epoch=epoch,
        timestamp=time.time(),
        preemptions=preemptions,
        draining_pages=book.drain_count,
        largest_request_bytes=largest_request_bytes,
        failed_requests=failed_requests,
    )
