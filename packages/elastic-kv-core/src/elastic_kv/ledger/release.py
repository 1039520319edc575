"""What happens to pages that empty: :class:`PageRelease`.

A page whose last block is freed waits behind the current epoch (``defer_release``: GPU work queued
before the free may still touch it), joins the reserve while the reserve is under its cap and the pool
within its limit, or is unmapped. A draining page (:mod:`elastic_kv.ledger.drain`) is never kept or
reused, only unmapped -- after its epoch with ``defer_release``. Releasing pages can end a drain: the pool
then follows its limit again (:meth:`Drain.follow <elastic_kv.ledger.drain.Drain.follow>`).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_kv.config import ElasticConfig
from elastic_kv.ledger.drain import Drain
from elastic_kv.ledger.page_backing import PageBacking
from elastic_kv.ledger.page_book import PageBook
from elastic_kv.ledger.physical import PhysicalAccount

__all__ = ["PageRelease"]


@dataclass(eq=False)
class PageRelease:
    """The fate of the emptied pages of ``book`` (see the module docstring), on the pool's owner thread."""

    book: PageBook
    backing: PageBacking
    phys: PhysicalAccount
    config: ElasticConfig
    drain: Drain

    def retire(self, pages: list[int], epoch: int) -> None:
        """Pages just emptied in ``epoch``: defer behind the epoch, keep in the reserve, or unmap; draining
        pages are withheld behind the epoch or unmapped."""
        book, drain, defer = self.book, self.drain, self.config.defer_release
        if book.drain_count:
            pages = drain.retire(pages, epoch, defer)
        if defer:
            book.defer(pages, epoch)
        else:
            self.release_empty(pages)
        if book.drain_count or drain.shown_over:
            drain.follow()  # the drain ends, and readers learn it, once within the limit

    def release_empty(self, pages: list[int]) -> None:
        """Empty backed pages that may be unmapped now: to the reserve while it is under its cap and the
        pool is within its limit, the rest unmapped in one data-plane transaction."""
        unmap: list[int] = []
        cap = self.config.reserve_max_pages
        for p in pages:
            if len(self.book.reserve) < cap and not self.phys.over_limit():
                self.book.keep_in_reserve([p])
            else:
                unmap.append(p)
        if unmap:
            self.backing.unmap_now(unmap)

    def release_through(self, epoch: int) -> int:
        """GPU work up to ``epoch`` finished: pages emptied in epochs <= ``epoch`` are released (draining
        ones unmapped). Returns how many pages left the pending or withheld state."""
        ready, drained = self.book.pop_released(epoch)
        if drained:
            self.backing.unmap_now(drained)
        if ready:
            self.release_empty(ready)
        if drained or (ready and (self.book.drain_count or self.drain.shown_over)):
            self.drain.follow()
        return len(ready) + len(drained)
