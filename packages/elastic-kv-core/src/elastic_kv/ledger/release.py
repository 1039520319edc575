"""What happens to pages that empty: :class:`PageRelease`.

A page whose last block is freed waits behind the current epoch (``defer_release``: GPU work queued
before the free may still touch it), joins the reserve while the reserve is under its cap and the pool
within its limit, or is unmapped. A draining page (:mod:`elastic_kv.ledger.drain`) is never kept or
reused, only unmapped -- after its epoch with ``defer_release``. Releasing pages can end a drain: the pool
then follows its limit again (:meth:`Drain.follow <elastic_kv.ledger.drain.Drain.follow>`).
"""

from __future__ import annotations

from elastic_kv.config import ElasticConfig
from elastic_kv.ledger.drain import Drain
from elastic_kv.ledger.page_backing import PageBacking
from elastic_kv.ledger.page_book import PageBook
from elastic_kv.ledger.physical import PhysicalAccount

__all__ = ["PageRelease"]


class PageRelease:
    """The fate of the emptied pages of ``book`` (see the module docstring), on the pool's owner thread."""

    def __init__(
        self, book: PageBook, backing: PageBacking, phys: PhysicalAccount, config: ElasticConfig, drain: Drain
    ) -> None:
        self._book = book
        self._backing = backing
        self._phys = phys
        self._cfg = config
        self._drain = drain

    def retire(self, pages: list[int], epoch: int) -> None:
        """Pages just emptied in ``epoch``: defer behind the epoch, keep in the reserve, or unmap; draining
        pages are withheld behind the epoch or unmapped."""
        book, drain, defer = self._book, self._drain, self._cfg.defer_release
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
        cap = self._cfg.reserve_max_pages
        for p in pages:
            if len(self._book.reserve) < cap and not self._phys.over_limit():
                self._book.keep_in_reserve([p])
            else:
                unmap.append(p)
        if unmap:
            self._backing.unmap_now(unmap)

    def release_through(self, epoch: int) -> int:
        """GPU work up to ``epoch`` finished: pages emptied in epochs <= ``epoch`` are released (draining
        ones unmapped). Returns how many pages left the pending or withheld state."""
        ready, drained = self._book.pop_released(epoch)
        if drained:
            self._backing.unmap_now(drained)
        if ready:
            self.release_empty(ready)
        if drained or (ready and (self._book.drain_count or self._drain.shown_over)):
            self._drain.follow()
        return len(ready) + len(drained)
