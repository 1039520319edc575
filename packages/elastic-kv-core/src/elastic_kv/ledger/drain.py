"""Limits drain pages: which pages in use a pool releases to get under a lowered limit.

When ``kvctl limit`` drops below what a pool holds, its reserve is unmapped at once and :class:`Drain`
chooses pages in use to *drain*: enough of them that releasing them gets the pool under the limit, in the
engine's order of preference (:attr:`Drain.order`: the fewest requests to preempt), else fewest live
blocks first. A draining page issues no block again (:meth:`PageBook.withhold
<elastic_kv.ledger.page_book.PageBook.withhold>`), so the blocks freed on it -- by requests finishing,
or by the engine preempting (vLLM) or retracting (SGLang) the requests that hold them -- are not handed
to other requests, and the page is unmapped once empty (after its epoch with ``defer_release``). The
pool is ``SHRINKING`` until its charge fits; a limit lifted or raised above the charge ends the drain at
once, and the first snapshot published after the drain ends says so. The ledger
(:class:`~elastic_kv.ledger.Ledger`) calls :meth:`Drain.apply_limit` for a new limit and
:meth:`Drain.follow` whenever its charge changes while it is, or was shown, over the limit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from elastic_kv.ledger.page_backing import PageBacking
from elastic_kv.ledger.page_book import USED, PageBook
from elastic_kv.ledger.physical import PhysicalAccount
from elastic_kv.snapshot import PoolSnapshot, PoolState

__all__ = ["Drain", "order_by_holders"]

logger = logging.getLogger("elastic_kv.ledger")


def order_by_holders(candidates: list[int], holdings: Iterable[Iterable[int]]) -> list[int]:
    """An engine's :attr:`Drain.order`: ``candidates`` (pages in use) ordered so that draining the first
    ``k`` of them costs as few requests as the engine's own preemption order allows.

    ``holdings`` gives, for each request the engine would preempt (or retract), first preempted first, the
    pages its blocks lie on. Pages no such request holds come first (only cached blocks are on them:
    evicted, nobody preempted); then, request by request, the pages whose last holder that request is --
    the pages that preempting it (after the ones before it) vacates, in the candidates' order among
    themselves. Candidates never completed are left out (the drain appends them in its own order)."""
    wanted = set(candidates)
    pages_of = [set(pages) & wanted for pages in holdings]
    holders: dict[int, int] = {}
    for pages in pages_of:
        for page in pages:
            holders[page] = holders.get(page, 0) + 1
    order = [page for page in candidates if page not in holders]
    rank = {page: i for i, page in enumerate(candidates)}
    for pages in pages_of:
        for page in sorted(pages, key=rank.__getitem__):  # the drain's own preference among equals
            holders[page] -= 1
            if not holders[page]:
                order.append(page)
    return order


class Drain:
    """The drain of one pool's ``book`` against the limit in ``phys`` (see the module docstring).

    Args:
        book: the pool's page book (its ``drain`` flags and withheld counts are the drain's state).
        phys: the pool's physical account (charge and limit).
        backing: unmaps draining pages as they empty.
        name: the pool's name, for the log.
        null_block: the pool's null block; its page is never chosen.
        snapshot: the pool's statistics now (:meth:`published` publishes them).
    """

    def __init__(
        self,
        book: PageBook,
        phys: PhysicalAccount,
        backing: PageBacking,
        name: str,
        null_block: int | None,
        snapshot: Callable[[], PoolSnapshot],
    ) -> None:
        self._book = book
        self._snapshot = snapshot
        self._phys = phys
        self._backing = backing
        self._name = name
        self._null_page = -1 if null_block is None else null_block // book.bpp
        # The engine's order of preference among pages to drain: called (on the owner thread) with the
        # candidate pages, fewest live blocks first, it returns them best first; pages it leaves out or
        # invents are ignored (see plan). None: the candidates' own order.
        self.order: Callable[[list[int]], list[int]] | None = None
        self.preemptions = 0  # requests the engine preempted (Ledger.note_preempted)
        self.shown_over = False  # the last snapshot published said "shrinking"

    def draining_pages(self) -> list[int]:
        """Draining pages that still hold live blocks, ascending."""
        book = self._book
        if not book.drain_count:
            return []
        st, drain = book.state, book.drain
        return [p for p in range(book.npages) if drain[p] and st[p] == USED]

    def holds_draining(self, blocks: Iterable[int]) -> bool:
        """Whether any of ``blocks`` (issued ids) lies on a draining page."""
        book = self._book
        if not book.drain_count:
            return False
        drain, bpp = book.drain, book.bpp
        return any(drain[b // bpp] for b in blocks)

    def retire(self, pages: list[int], epoch: int, defer: bool) -> list[int]:
        """Pages just emptied: the draining ones are never kept or reused, only unmapped -- now, or with
        ``defer`` once ``epoch`` is released (``WITHHELD``). Returns the other pages."""
        drain = self._book.drain
        drained = [p for p in pages if drain[p]]
        if not drained:
            return pages
        rest = [p for p in pages if not drain[p]]  # before unmapping: that ends the pages' drain
        if defer:
            self._book.withhold_emptied(drained, epoch)
        else:
            self._backing.unmap_now(drained)
        return rest

    def published(self) -> PoolSnapshot:
        """A snapshot about to be published; remembers whether it says "shrinking"."""
        snap = self._snapshot()
        self.shown_over = snap.state is PoolState.SHRINKING
        return snap

    def apply_limit(self, limit_bytes: int) -> None:
        """A new limit: over it, the reserve is unmapped now and pages in use start draining; within it,
        any drain ends."""
        phys = self._phys
        phys.limit = limit_bytes
        if phys.over_limit():
            self._backing.unmap_reserve(0)
            logger.info("pool %s shrinking: %d bytes backed, limit %d", self._name, phys.charged, phys.limit)
        self.follow(publish=False)

    def follow(self, publish: bool = True) -> None:
        """Keep the drain matched to the limit: over it, enough pages draining to get under it
        (:meth:`plan`); under it (pages were released, or the limit was lifted or raised), none -- and
        with ``publish``, readers learn at once that the pool stopped shrinking."""
        phys = self._phys
        if phys.over_limit():
            self.plan()
            return
        book = self._book
        if book.drain_count:
            for p in book.mapped_pages():
                book.unwithhold(p)
        if publish and self.shown_over and phys.shares:
            phys.publish_now(self.published())

    def plan(self) -> None:
        """Choose pages to release until what the pool is returning covers its excess over the limit:
        empty backed pages and pages in flight go anyway (they are unmapped while the pool is over its
        limit); beyond those, pages in use in the engine's order (:attr:`order`: an engine that knows
        which request holds which block orders them so that the fewest requests must be preempted), else
        those with the fewest live blocks, most recently mapped first among equals. A chosen page issues
        no block from now on and is unmapped once its last block is freed. The null block's page is never
        chosen. Counts whole pages (``page_bytes``): where pages share slots, or an empty page counted as
        leaving is reused instead, the next call tops the drain up."""
        book, phys = self._book, self._phys
        page_bytes = book.geo.page_bytes
        excess = phys.charged - phys.limit
        leaving = len(book.reserve) + len(book.pending_epoch) + book.inflight_pages + book.drain_count
        short = excess - leaving * page_bytes
        if short <= 0 or not page_bytes:
            return
        st, drain, null_page = book.state, book.drain, self._null_page
        candidates = [p for p in range(book.npages) if st[p] == USED and not drain[p] and p != null_page]
        candidates.sort(key=lambda p: (book.live_blocks_on(p), -p))
        if self.order is not None:
            allowed = set(candidates)
            preferred = list(dict.fromkeys(p for p in self.order(candidates) if p in allowed))
            taken = set(preferred)
            candidates = preferred + [p for p in candidates if p not in taken]
        for p in candidates[: -(-short // page_bytes)]:
            book.withhold(p)
        logger.info("pool %s over its limit: %d page(s) draining", self._name, book.drain_count)
