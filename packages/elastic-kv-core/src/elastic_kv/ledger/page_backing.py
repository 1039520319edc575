"""The pool's link to the data plane and to its shared record: backing and releasing pages.

:class:`PageBacking` does for a :class:`~elastic_kv.ledger.page_book.PageBook` everything that leaves the
process's memory: charging the record and mapping pages through the
:class:`~elastic_kv.ledger.page_mapper.PageMapper`, synchronously or on the data plane's background thread,
unmapping them, and what a failure there means:

* ``PoolExhausted`` from the record, the limit or the driver: pressure -- nothing changed, the caller
  reports "no blocks now";
* another driver error the data plane rolled back: nothing changed; raised on map, and on unmap the
  pages simply stay backed (the ledger retries);
* ``StateConsistencyError`` (a rollback failed) or a ``ValueError`` from the data plane (the ledger and the
  data plane disagree on a page): the pool's :class:`~elastic_kv.ledger.guard.PoolGuard` marks it
  inconsistent, and it refuses all further work.

Policy -- when to map, what to keep -- is the ledger's (:class:`~elastic_kv.ledger.Ledger`).
"""

from __future__ import annotations

import logging
import time

from elastic_kv.errors import PoolExhausted, StateConsistencyError
from elastic_kv.ledger.guard import PoolGuard
from elastic_kv.ledger.page_book import INFLIGHT, UNMAPPED, PageBook
from elastic_kv.ledger.page_mapper import AsyncPageMapper, PageMapper
from elastic_kv.ledger.physical import PhysicalAccount

__all__ = ["PageBacking"]

logger = logging.getLogger("elastic_kv.ledger")


class PageBacking:
    """Backs and releases the pages of ``book`` through ``mapper``, charging ``phys`` (see the module
    docstring). A data-plane inconsistency goes to ``guard.fail``."""

    def __init__(self, book: PageBook, mapper: PageMapper, phys: PhysicalAccount, guard: PoolGuard) -> None:
        self._book = book
        self._geo = book.geo
        self._mapper = mapper
        # Checked once: isinstance against a runtime-checkable Protocol inspects the class every time.
        self._async_mapper: AsyncPageMapper | None = mapper if isinstance(mapper, AsyncPageMapper) else None
        self.is_async = self._async_mapper is not None
        self._phys = phys
        self._guard = guard
        self._name = guard.name

    # -- synchronous ------------------------------------------------------------------------------------

    def map_now(self, pages: list[int]) -> None:
        """Charge and back ``pages`` synchronously. Raises (with the charge returned and the data plane
        unchanged) ``PoolExhausted`` when the limit, the budget or the driver refuses, or the data plane's
        error for another driver failure; marks the pool inconsistent if the data plane is."""
        nbytes = self._geo.exclusive_bytes(pages, self._book.is_backed)
        if not self._phys.charge(nbytes):
            raise PoolExhausted(f"pool {self._name}: no room for {nbytes} more bytes (limit or budget)")
        start = time.perf_counter()
        try:
            self._mapper.map(pages)
        except PoolExhausted:
            self._phys.uncharge(nbytes)
            self._phys.stale()  # re-read the driver's free memory at the next maintain()
            raise
        except StateConsistencyError as exc:
            self._guard.fail(f"map of pages {pages} failed to roll back: {exc}")
        except ValueError as exc:
            self._guard.fail(f"data plane refused to map pages {pages} the ledger holds unmapped: {exc}")
        except BaseException:
            self._phys.uncharge(nbytes)
            raise
        self._phys.observe("map", time.perf_counter() - start)

    def unmap_now(self, pages: list[int], *, closing: bool = False) -> None:
        """Unmap backed, empty pages and return their charge (at close: every page, live or not).

        A driver error that the data plane rolled back (the pages stay mapped) is pressure, not a fault:
        the pages stay backed in the reserve, over its target, and the next maintain() tries again."""
        nbytes = self._geo.exclusive_bytes(pages, self._book.is_backed)
        start = time.perf_counter()
        try:
            self._mapper.unmap(pages)
        except (StateConsistencyError, ValueError) as exc:
            self._guard.fail(f"unmap of pages {pages} failed: {exc}")
        except Exception as exc:
            if closing:
                raise
            logger.warning(
                "pool %s: unmap of pages %s failed, keeping them backed: %s", self._name, pages, exc
            )
            for p in pages:
                self._book.cancel_drain(p)
            self._book.keep_in_reserve(pages)
            return
        self._phys.observe("unmap", time.perf_counter() - start)
        self._book.unback(pages)
        self._phys.uncharge(nbytes)

    def unmap_reserve(self, keep: int) -> int:
        """Unmap the reserve's oldest pages, all but the ``keep`` most recently added; returns how many."""
        excess = len(self._book.reserve) - keep
        if excess <= 0:
            return 0
        pages = self._book.take_oldest_reserve(excess)
        self.unmap_now(pages)
        return len(pages)

    # -- background -------------------------------------------------------------------------------------

    def refill_async(self, want: int) -> None:
        """Queue up to ``want`` pages for the background thread, within the physical headroom (charged
        now, so that two pools cannot both count on the same bytes)."""
        pages: list[int] = []
        try:
            while want > 0 and self._book.unmapped and not self._phys.over_limit():
                page = self._book.unmapped[-1]
                if not self._phys.charge(self._geo.exclusive_bytes([page], self._book.is_backed)):
                    break
                self._book.pop_unmapped()
                self._book.state[page] = INFLIGHT
                self._book.inflight_pages += 1
                pages.append(page)
                want -= 1
            if pages:
                assert self._async_mapper is not None
                job = self._async_mapper.map_async(pages)
                self._book.inflight[job] = pages
        except BaseException:
            # the record refused unexpectedly, or the data plane did not queue the job: nothing was queued
            if pages:
                self.undo_inflight(pages)
            raise

    def queue_each(self, want: int) -> int:
        """Queue up to ``want`` pages, one background job each (so that an allocation waits only for the
        pages it needs), while the headroom lasts; returns how many were queued."""
        before = self._book.inflight_pages
        for _ in range(want):
            queued = self._book.inflight_pages
            self.refill_async(1)
            if self._book.inflight_pages == queued:
                break  # no headroom left
        return self._book.inflight_pages - before

    def refill_sync(self, want: int) -> None:
        """Map up to ``want`` reserve pages on this thread (mappers without a background thread)."""
        pages = [self._book.pop_unmapped() for _ in range(min(want, len(self._book.unmapped)))]
        if pages:
            self.back_now(pages)

    def back_now(self, pages: list[int]) -> bool:
        """Back ``pages``, just popped off the unmapped stack, on this thread: True when they joined the
        reserve; False (``PoolExhausted``: limit, budget or driver) or the data plane's error, with the
        pages back on the unmapped stack and nothing else changed."""
        try:
            self.map_now(pages)
        except PoolExhausted:
            self._book.unpop_unmapped(pages)
            return False
        except BaseException:
            self._book.unpop_unmapped(pages)  # a driver error after the data plane's rollback
            raise
        for p in pages:
            self._book.page_to_reserve(p)
        return True

    def collect(self, wait: bool = False, jobs: int = 0) -> None:
        """Take in the background maps that finished (with ``wait``, all of them, or at least the ``jobs``
        oldest): mapped pages join the reserve, failed ones return to the unmapped pages with their
        charge."""
        assert self._async_mapper is not None
        for job, pages, error in self._async_mapper.collect(wait, jobs):
            mine = self._book.inflight.pop(job, None)
            if mine is None or sorted(mine) != sorted(pages):
                self._guard.fail(f"data plane reported map job {job} ({pages}) that the ledger did not queue")
            assert mine is not None
            if error is None:
                for p in mine:
                    self._book.inflight_pages -= 1
                    self._book.page_to_reserve(p)
            elif error.startswith("StateConsistencyError"):
                self._guard.fail(f"background map of pages {mine} failed to roll back: {error}")
            else:  # PoolExhausted, a driver error rolled back, or cancelled: nothing was mapped
                logger.debug("background map of pages %s failed: %s", mine, error)
                self._phys.stale()
                self.undo_inflight(mine)

    def undo_inflight(self, pages: list[int]) -> None:
        """In-flight pages that will not be mapped: back to unmapped, their charge returned."""
        nbytes = self._geo.exclusive_bytes(pages, self._book.is_backed)
        for p in pages:
            self._book.state[p] = UNMAPPED
            self._book.inflight_pages -= 1
        self._book.push_unmapped(pages)
        self._phys.uncharge(nbytes)
