"""The pool's link to the data plane and to its shared record: backing pages, and the pool's health.

:class:`PageBacking` extends the bookkeeping of :class:`~elastic_kv.pagebook.PageBook` with everything that
leaves the process's memory: charging the record and mapping pages through the
:class:`~elastic_kv.mapper.PageMapper`, synchronously or on the data plane's background thread, unmapping
them, and what a failure there means:

* ``PoolExhausted`` from the record, the limit or the driver: pressure -- nothing changed, the caller
  reports "no blocks now";
* another driver error the data plane rolled back: nothing changed; raised on map, and on unmap the
  pages simply stay backed (the ledger retries);
* ``StateConsistencyError`` (a rollback failed) or a ``ValueError`` from the data plane (the ledger and the
  data plane disagree on a page): the pool is marked inconsistent and refuses all further work.

It also holds the pool's owner thread: the one comparison on every hot path (``get_ident() !=
self._owner``) checks both "right thread" and "pool usable", because ``_owner`` becomes -1 once the pool
is closed or inconsistent. Policy -- when to map, what to keep -- is the ledger's
(:class:`~elastic_kv.ledger.KVCacheManager`).
"""

from __future__ import annotations

import logging
import time
from threading import get_ident

from elastic_kv.errors import PoolExhausted, StateConsistencyError
from elastic_kv.geometry import BlockGeometry
from elastic_kv.mapper import AsyncPageMapper, PageMapper
from elastic_kv.pagebook import INFLIGHT, RESERVE, UNMAPPED, PageBook
from elastic_kv.physical import PhysicalAccount

__all__ = ["PageBacking"]

logger = logging.getLogger("elastic_kv.ledger")


class PageBacking(PageBook):
    """Backs and releases the pages of a :class:`PageBook` (see the module docstring)."""

    def __init__(self, geometry: BlockGeometry, mapper: PageMapper, phys: PhysicalAccount, name: str) -> None:
        super().__init__(geometry)
        self._mapper = mapper
        # Checked once: isinstance against a runtime-checkable Protocol inspects the class every time.
        self._async_mapper: AsyncPageMapper | None = mapper if isinstance(mapper, AsyncPageMapper) else None
        self._async = self._async_mapper is not None
        self._phys = phys
        self._name = name
        self._broken: str | None = None
        self._closed = False
        # The owner thread's ident while the pool is usable, -1 once it is closed or inconsistent.
        self._thread = get_ident()
        self._owner = self._thread

    # -- synchronous ------------------------------------------------------------------------------------

    def _map_now(self, pages: list[int]) -> None:
        """Charge and back ``pages`` synchronously. Raises (with the charge returned and the data plane
        unchanged) ``PoolExhausted`` when the limit, the budget or the driver refuses, or the data plane's
        error for another driver failure; marks the pool inconsistent if the data plane is."""
        nbytes = self._geo.exclusive_bytes(pages, self._is_backed)
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
            self._fail(f"map of pages {pages} failed to roll back: {exc}")
        except ValueError as exc:
            self._fail(f"data plane refused to map pages {pages} the ledger holds unmapped: {exc}")
        except BaseException:
            self._phys.uncharge(nbytes)
            raise
        self._phys.observe("map", time.perf_counter() - start)

    def _unmap_now(self, pages: list[int], *, closing: bool = False) -> None:
        """Unmap backed, empty pages and return their charge (at close: every page, live or not).

        A driver error that the data plane rolled back (the pages stay mapped) is pressure, not a fault:
        the pages stay backed in the reserve, over its target, and the next maintain() tries again."""
        nbytes = self._geo.exclusive_bytes(pages, self._is_backed)
        start = time.perf_counter()
        try:
            self._mapper.unmap(pages)
        except (StateConsistencyError, ValueError) as exc:
            self._fail(f"unmap of pages {pages} failed: {exc}")
        except Exception as exc:
            if closing:
                raise
            logger.warning(
                "pool %s: unmap of pages %s failed, keeping them backed: %s", self._name, pages, exc
            )
            for p in pages:
                self._cancel_drain(p)
                self._page_state[p] = RESERVE
            self._reserve.extend(pages)
            return
        self._phys.observe("unmap", time.perf_counter() - start)
        self._unback(pages)
        self._phys.uncharge(nbytes)

    def _fail(self, message: str) -> None:
        self._broken = message
        self._owner = -1
        logger.error("pool %s is inconsistent: %s", self._name, message)
        raise StateConsistencyError(f"pool {self._name}: {message}")

    def _refuse(self) -> None:
        """Raise why the calling thread may not change the pool now."""
        self._check_thread()
        if self._closed:
            raise ValueError(f"pool {self._name} is closed")
        if self._broken is not None:
            raise StateConsistencyError(f"pool {self._name} is inconsistent: {self._broken}")

    def _check_thread(self) -> None:
        if get_ident() != self._thread:
            raise RuntimeError(
                f"pool {self._name} is driven by thread {self._thread}, not {get_ident()}: call "
                f"bind_thread() on the thread that drives it (a pool is not shared between threads)"
            )

    def bind_thread(self) -> None:
        """Make the calling thread the pool's owner (e.g. the pool was built on a start-up thread and the
        engine schedules on another). The previous owner must not touch the pool any more."""
        self._thread = get_ident()
        if not self._closed and self._broken is None:
            self._owner = self._thread

    # -- background -------------------------------------------------------------------------------------

    def _refill_async(self, want: int) -> None:
        """Queue up to ``want`` pages for the background thread, within the physical headroom (charged
        now, so that two pools cannot both count on the same bytes)."""
        pages: list[int] = []
        try:
            while want > 0 and self._unmapped and not self._phys.over_limit():
                page = self._unmapped[-1]
                if not self._phys.charge(self._geo.exclusive_bytes([page], self._is_backed)):
                    break
                self._pop_unmapped()
                self._page_state[page] = INFLIGHT
                self._inflight_pages += 1
                pages.append(page)
                want -= 1
            if pages:
                assert self._async_mapper is not None
                job = self._async_mapper.map_async(pages)
                self._inflight[job] = pages
        except BaseException:
            # the record refused unexpectedly, or the data plane did not queue the job: nothing was queued
            if pages:
                self._undo_inflight(pages)
            raise

    def _refill_sync(self, want: int) -> None:
        """Map up to ``want`` reserve pages on this thread (mappers without a background thread)."""
        pages = [self._pop_unmapped() for _ in range(min(want, len(self._unmapped)))]
        if not pages:
            return
        try:
            self._map_now(pages)
        except PoolExhausted:
            self._unpop_unmapped(pages)
            return
        except BaseException:
            self._unpop_unmapped(pages)
            raise
        for p in pages:
            self._page_to_reserve(p)

    def _collect(self, wait: bool = False, jobs: int = 0) -> None:
        """Take in the background maps that finished (with ``wait``, all of them, or at least the ``jobs``
        oldest): mapped pages join the reserve, failed ones return to the unmapped pages with their
        charge."""
        assert self._async_mapper is not None
        for job, pages, error in self._async_mapper.collect(wait, jobs):
            mine = self._inflight.pop(job, None)
            if mine is None or sorted(mine) != sorted(pages):
                self._fail(f"data plane reported map job {job} ({pages}) that the ledger did not queue")
            assert mine is not None
            if error is None:
                for p in mine:
                    self._inflight_pages -= 1
                    self._page_to_reserve(p)
            elif error.startswith("StateConsistencyError"):
                self._fail(f"background map of pages {mine} failed to roll back: {error}")
            else:  # PoolExhausted, a driver error rolled back, or cancelled: nothing was mapped
                logger.debug("background map of pages %s failed: %s", mine, error)
                self._phys.stale()
                self._undo_inflight(mine)

    def _undo_inflight(self, pages: list[int]) -> None:
        """In-flight pages that will not be mapped: back to unmapped, their charge returned."""
        nbytes = self._geo.exclusive_bytes(pages, self._is_backed)
        for p in pages:
            self._page_state[p] = UNMAPPED
            self._inflight_pages -= 1
        self._push_unmapped(pages)
        self._phys.uncharge(nbytes)
