"""The ledger of one pool: :class:`Ledger` (the design is in the package docstring,
:mod:`elastic_kv.ledger`).

One file over 400 lines on purpose: it is the engines' whole interface to a pool, one class whose methods
are each a short decision over the collaborators beside it (page book, backing, release, drain, physical
account, reserve policy, fit), with its contract written at each method; the work is in those modules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from threading import get_ident
from typing import TYPE_CHECKING

from elastic_kv.config import ElasticConfig
from elastic_kv.errors import PoolExhausted
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ledger.drain import Drain
from elastic_kv.ledger.fit import blocks_within, bytes_for_blocks
from elastic_kv.ledger.guard import PoolGuard
from elastic_kv.ledger.page_backing import PageBacking
from elastic_kv.ledger.page_book import PageBook
from elastic_kv.ledger.page_mapper import PageMapper
from elastic_kv.ledger.physical import PhysicalAccount
from elastic_kv.ledger.release import PageRelease
from elastic_kv.ledger.reserve import ReservePolicy
from elastic_kv.ledger.stats import pool_snapshot
from elastic_kv.snapshot import PoolSnapshot

if TYPE_CHECKING:
    from elastic_kv.registry import DeviceShare, PoolRecord

__all__ = ["Ledger"]

logger = logging.getLogger(__name__)


class Ledger:
    """Block ids for one engine KV pool, backed page by page (see :mod:`elastic_kv.ledger`).

    It holds the pool's :class:`~elastic_kv.ledger.page_book.PageBook` (free blocks per page, page
    states), its :class:`~elastic_kv.ledger.page_backing.PageBacking` (the data plane and the shared
    record), its :class:`~elastic_kv.ledger.guard.PoolGuard` (owner thread, health), its
    :class:`~elastic_kv.ledger.drain.Drain` (the pages released to meet a lowered limit) and the policy:
    which pages to take, when to map, unmap, defer or refill.

    Args:
        geometry: the engine's layout (blocks, pages, extents); the mapper's pages are its pages.
        mapper: backs and releases pages (``LocalMapper`` over a ``_vmm.SpaceGroup``, or the ranks'
            coordinator). If it is an :class:`~elastic_kv.ledger.page_mapper.AsyncPageMapper`, the reserve
            is refilled in the background.
        config: reserve watermarks, deferred release, limit, ...
        record: the pool's shared record (limit, GPU-wide budget, statistics); ``None`` = no sharing.
        shares: instead of ``record``, one record per device for a pool whose ranks back each page on
            several devices, or several ranks on one (:func:`elastic_kv.registry.create_shares`); the
            ledger counts one rank's bytes, each record is charged for the ranks on its device.
        name: the pool's name in snapshots.
        null_block: a block id reserved at start-up and backed for the pool's lifetime (vLLM: block 0;
            SGLang: slot/page 0, the padding target); ``None`` for none.
        physical_free: bytes the device could still back (driver free memory); called from
            :meth:`maintain` at most every ``config.free_memory_ttl_s``, never on the allocation path.
        book_type: the page book's class; a subclass changes which free blocks are taken
            (``benchmarks/ledger_trace.py`` compares such rules).

    Raises:
        PoolExhausted: the null block's page cannot be backed, after waiting ``config.start_wait_s`` for
            room where a limit or the budget refused it.
        ValueError: ``null_block`` out of range.
    """

    def __init__(
        self,
        geometry: BlockGeometry,
        mapper: PageMapper,
        config: ElasticConfig | None = None,
        *,
        record: PoolRecord | None = None,
        name: str = "pool",
        null_block: int | None = 0,
        physical_free: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        shares: Sequence[DeviceShare] = (),
        book_type: type[PageBook] = PageBook,
    ) -> None:
        cfg = config or ElasticConfig()
        if shares and record is not None:
            raise ValueError("pass either record or shares, not both")
        self._geo = geometry
        self._name = name
        self._phys = PhysicalAccount(cfg, record, physical_free, clock, shares)
        self._book = book_type(geometry)
        self._guard = PoolGuard(name)
        self._backing = PageBacking(self._book, mapper, self._phys, self._guard)
        self._async = self._backing.is_async
        nb, bpp = self._book.nb, self._book.bpp
        self._cfg = cfg
        self._epoch = 0
        self._hits = 0
        self._misses = 0
        self._policy = ReservePolicy(cfg.reserve_min_pages, cfg.reserve_max_pages, cfg.reserve_window)
        self._light = False  # the last maintain() was for a light step
        self._trimmed = False  # the reserve was returned (kvctl trim, trim()): refilled on the next alloc

        self._null = null_block
        if null_block is not None:
            if not 0 <= null_block < nb:
                raise ValueError(f"null_block={null_block} outside 0..{nb - 1}")
            page = null_block // bpp
            self._book.take_unmapped(page)
            self._map_first_page(page, cfg.start_wait_s, clock)
            self._book.hold_null(null_block)
        self._drain = Drain(self._book, self._phys, self._backing, name, null_block, self._snapshot)
        self._release = PageRelease(self._book, self._backing, self._phys, cfg, self._drain)
        self._phys.refresh(force=True)
        self._largest_request = 0  # blocks the engine's largest unfinished request needs
        self._failed = 0  # requests the engine ended because they need more than the ceiling (note_failed)
        self._fit_blocks = 0  # max_request_blocks under the current ceiling
        self._follow_ceiling()

    def _map_first_page(self, page: int, wait_s: float, clock: Callable[[], float]) -> None:
        """Back the null block's page. While a limit or the device budget has no room for it (neighbours
        hold the budget: they give it back as their requests end), wait for it up to ``wait_s``, rather
        than fail a whole engine's start for one page; then ``PoolExhausted``."""
        deadline = clock() + wait_s
        pause = 0.02
        while True:
            try:
                self._backing.map_now([page])
                return
            except PoolExhausted:
                if clock() >= deadline:
                    raise
                if pause == 0.02:
                    logger.info(
                        "pool %s: waiting up to %.0f s for room for its first page", self._name, wait_s
                    )
                time.sleep(pause)
                pause = min(0.5, pause * 2)
                self._phys.refresh(force=True)

    # -- queries ----------------------------------------------------------------------------------------

    @property
    def geometry(self) -> BlockGeometry:
        """The geometry this pool follows."""
        return self._geo

    @property
    def null_block(self) -> int | None:
        """The reserved null block id, or ``None``."""
        return self._null

    @property
    def epoch(self) -> int:
        """The current release epoch (see :meth:`advance_epoch`)."""
        return self._epoch

    @property
    def charged_bytes(self) -> int:
        """Physical bytes charged for backed and in-flight pages (== the data plane's mapped bytes once
        in-flight jobs are collected)."""
        return self._phys.charged

    @property
    def used_blocks(self) -> int:
        """Live blocks issued to the engine (the null block excluded)."""
        return self._book.live_count() - (self._null is not None)

    def over_limit(self) -> bool:
        """True while the pool holds more than its limit (``kvctl limit`` lowered it below what is backed):
        it is shrinking. Its draining pages (:meth:`draining_pages`) issue no block, and memory comes back
        as the blocks on them are freed."""
        return self._phys.over_limit()

    # -- the drain (.drain): what engines read and report while the pool shrinks ------------------------

    @property
    def draining(self) -> bool:
        """Whether any page is draining (O(1): engines check it every step)."""
        return self._book.drain_count > 0

    def is_draining(self, page: int) -> bool:
        """Whether ``page`` is being released to meet a lowered limit (no block on it is issued)."""
        return bool(self._book.drain[page])

    def draining_pages(self) -> list[int]:
        """Draining pages that still hold live blocks, ascending: the engine frees them (preempts, evicts)."""
        return self._drain.draining_pages()

    def holds_draining(self, blocks: Iterable[int]) -> bool:
        """Whether any of ``blocks`` (issued ids) lies on a draining page."""
        return self._drain.holds_draining(blocks)

    @property
    def drain_order(self) -> Callable[[list[int]], list[int]] | None:
        """The engine's order of preference among pages to drain (:attr:`.drain.Drain.order`)."""
        return self._drain.order

    @drain_order.setter
    def drain_order(self, order: Callable[[list[int]], list[int]] | None) -> None:
        self._drain.order = order

    @property
    def preemptions(self) -> int:
        """Requests the engine preempted since the pool started (:meth:`note_preempted`)."""
        return self._drain.preemptions

    def note_preempted(self, requests: int = 1) -> None:
        """The engine preempted ``requests`` requests: counted in the snapshot (``kvctl limit --wait``)."""
        self._drain.preemptions += requests

    # -- requests that cannot fit: what the ceiling lets them hold, what engines report (.fit) ------------

    @property
    def max_request_blocks(self) -> int:
        """The most blocks the engine's requests can hold together under the pool's ceiling -- its limit and
        its devices' budgets (:mod:`elastic_kv.ledger.fit`) -- or every block it can issue when neither is
        set. A request that needs more can never run until ``kvctl`` raises the ceiling: engines end it
        with an error rather than let it wait. O(1); follows ``kvctl``'s changes from :meth:`maintain`."""
        return self._fit_blocks

    def max_request_blocks_now(self) -> int:
        """:attr:`max_request_blocks` under the limit and budgets the records hold now, which ``maintain``
        may not have applied yet: an engine about to end a request checks this first, so a ceiling that
        ``kvctl`` just raised ends nothing. Reads the records' mappings; any thread."""
        return self._blocks_under(self._phys.ceiling(fresh=True))

    def bytes_for_blocks(self, blocks: int) -> int:
        """The least the pool must hold (one rank's bytes) for requests to hold ``blocks`` blocks beside its
        null block; 0 for none (:func:`elastic_kv.ledger.fit.bytes_for_blocks`)."""
        return bytes_for_blocks(self._geo, blocks, null_block=self._null is not None)

    def refresh_room(self) -> None:
        """Re-read the physical headroom (records and driver) that :meth:`available_size` uses, whatever its
        age, for an engine about to admit requests on it: another pool may have taken the budget since the
        last reading, and an engine whose allocation then fails after admission may not recover (SGLang's
        does not). A record read where the budget binds and a driver query: microseconds, once per
        admission pass. What another pool takes between this and the allocation is still a race."""
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        self._phys.refresh(force=True)

    def outside_room(self) -> int:
        """Bytes the pool's records (its limit, its devices' budgets) and the driver's free memory would let
        it charge now, read afresh rather than from the cache ``maintain`` refreshes. Any thread: an engine
        waiting for room watches it grow from another thread."""
        return self._phys.outside_room()

    def note_largest_request(self, blocks: int) -> None:
        """The engine's largest unfinished request needs ``blocks`` blocks to take its next step (0: no
        request). Published as the snapshot's ``largest_request_bytes``, below which ``kvctl`` refuses a
        limit or a budget. Any thread (a plain store)."""
        self._largest_request = max(0, blocks)

    @property
    def failed_requests(self) -> int:
        """Requests the engine ended because they need more than the ceiling (:meth:`note_failed`)."""
        return self._failed

    def note_failed(self, requests: int = 1) -> None:
        """The engine ended ``requests`` requests with an error because they need more blocks than
        :attr:`max_request_blocks`: counted in the snapshot (``kvctl limit --wait`` reports them)."""
        self._failed += requests

    def _follow_ceiling(self) -> None:
        """Recompute :attr:`max_request_blocks` from the limit and the budgets now in force."""
        self._fit_blocks = self._blocks_under(self._phys.ceiling())

    def _blocks_under(self, ceiling: int) -> int:
        has_null = self._null is not None
        if not ceiling:
            return self._book.nb - has_null
        return blocks_within(self._geo, ceiling, null_block=has_null)

    @property
    def free_backed_blocks(self) -> int:
        """Free blocks on backed pages (partly used, reserve, pending): what ``alloc`` serves without a
        driver call. O(1), no lock (a single int read); engines use it to decide whether an allocation
        can be made without mapping."""
        return self._book.free_backed

    @property
    def reserve_hit_rate(self) -> float:
        """Fraction of new pages served already mapped (from the reserve or pending pages) rather than
        mapped on the allocating thread; 1.0 before any."""
        total = self._hits + self._misses
        return 1.0 if total == 0 else self._hits / total

    def available_size(self, fresh: bool = False) -> int:
        """Blocks an ``alloc`` could get now: free blocks on backed pages plus pages in flight, plus as many
        unbacked pages as the physical headroom (limit, shared record, driver free memory) can back.

        O(1), no driver or shared-memory access. A hint, like vLLM's ``get_num_free_blocks``: another pool
        may take the GPU-wide budget first, so ``alloc`` may still answer ``None``. ``fresh``: with the
        headroom the records and the driver give now rather than as last read (:meth:`outside_room`'s
        reads; any ``kvctl`` change not yet applied counts only where it lowers the room).
        """
        room = self._phys.room(fresh)
        page_bytes = self._geo.page_bytes
        pages = room // page_bytes if page_bytes else 0
        return (
            self._book.free_backed
            + self._book.inflight_pages * self._book.bpp
            + min(self._book.unmapped_blocks, pages * self._book.bpp)
        )

    def page_state(self, page: int) -> str:
        """``"unmapped" | "used" | "reserve" | "pending" | "inflight" | "withheld"`` (for diagnostics)."""
        return self._book.page_state(page)

    def is_live(self, block: int) -> bool:
        """Whether ``block`` is issued (the null block is always live)."""
        return self._book.is_live(block)

    def live_blocks_on(self, page: int) -> int:
        """Issued blocks of ``page`` (the null block counts); O(1)."""
        return self._book.live_blocks_on(page)

    def mapped_pages(self) -> list[int]:
        """Pages the ledger holds backed (used, reserve, pending, withheld), ascending."""
        return self._book.mapped_pages()

    def check_invariants(self) -> None:
        """Verify the page book's invariants (:mod:`elastic_kv.ledger.page_book`); ``AssertionError``
        names the first one broken. O(blocks + pages): for tests, soaks and debugging only."""
        self._book.check_invariants()

    def bind_thread(self) -> None:
        """Make the calling thread the pool's owner (e.g. the pool was built on a start-up thread and the
        engine schedules on another). The previous owner must not touch the pool any more."""
        self._guard.bind_thread()

    # -- allocation -------------------------------------------------------------------------------------

    def alloc(self, n: int) -> list[int] | None:
        """Exactly ``n`` free block ids, now live, or ``None`` with nothing taken.

        ``None`` means physical pressure (limit, GPU-wide budget, driver out of memory) or too few blocks:
        the engine waits or preempts, as when its native pool is full. ``ValueError`` if ``n < 0``;
        :class:`StateConsistencyError` if the data plane lost track of a page (the pool is then unusable).
        """
        if n <= 0:
            if n < 0:
                raise ValueError(f"cannot allocate {n} blocks")
            return []
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        self._trimmed = False
        out = self._book.take_fit(n)
        return out if out is not None else self._alloc_pages(n)

    def _alloc_pages(self, n: int) -> list[int] | None:
        """``alloc`` when no single partly used page holds the run: take in finished background maps,
        grow if the backed pages are still short, then take. Empty pages that were backed before the call
        (reserve, pending, background maps already done) count as reserve hits; pages this call had to
        wait for or map count as misses."""
        book = self._book
        if n > book.free_backed and book.inflight:
            self._take_in()
        ready = len(book.reserve) + len(book.pending_epoch)
        if n > book.free_backed and not self._grow(n):
            return None
        out, acquired = book.take_blocks(n)
        if acquired:
            missed = max(0, acquired - ready)
            self._misses += missed
            self._hits += acquired - missed
            self._policy.note_acquired(acquired)
            if self._async and self._cfg.premap:
                self._backing.refill_async(self._reserve_goal() - len(book.reserve) - book.inflight_pages)
        return out

    def _grow(self, n: int) -> bool:
        """Make ``free_backed >= n``: wait for the background maps that cover the shortfall (the oldest
        first: they finish first; the rest keep landing while the engine runs), then -- only if those
        failed -- for all of them (a synchronous map would queue behind them in the driver anyway), and
        map what is still missing. False -- with nothing changed but pages that landed -- when the pool
        cannot grow that much."""
        book = self._book
        if book.inflight:
            self._take_in(wait=True, jobs=book.jobs_covering(n - book.free_backed))
            if n > book.free_backed and book.inflight:
                self._take_in(wait=True)
        short = n - book.free_backed
        if short <= 0:
            return True
        if short > book.unmapped_blocks or self._phys.over_limit():
            return False  # too few blocks, or shrinking: no new pages until live blocks drain
        return self._backing.back_now(self._book.pop_unmapped_for(short))

    def free(self, ids: Iterable[int]) -> None:
        """Return live blocks. Pages that empty go to the reserve (up to its cap), wait for
        :meth:`release_through` (``defer_release``), or are unmapped.

        ``ids`` must be Python ints. ``ValueError`` with nothing changed if an id is out of range, not live
        (double free, never issued, another pool's id), repeated, or the null block.
        """
        blocks = ids if type(ids) is list else list(ids)
        if not blocks:
            return
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        self._book.check_free(blocks)
        emptied = self._book.return_blocks(blocks)
        if emptied:
            self._release.retire(emptied, self._epoch)

    # -- epochs -----------------------------------------------------------------------------------------

    def advance_epoch(self) -> int:
        """Start a new release epoch and return its number. Call it when the engine launches GPU work that
        may touch blocks freed later; pages emptied from now on wait for ``release_through`` of this
        epoch (or a later one) before they can be unmapped."""
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        self._epoch += 1
        return self._epoch

    def release_through(self, epoch: int) -> int:
        """The engine's GPU work launched up to ``epoch`` has finished: pages emptied in epochs <= ``epoch``
        may be unmapped now (or kept in the reserve; draining pages are unmapped). Returns how many pages
        left the pending or withheld state."""
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        return self._release.release_through(epoch)

    # -- background pre-mapping -------------------------------------------------------------------------

    def maintain(self, light: bool = False) -> None:
        """Housekeeping; call once per engine step, after the step's allocations (cheap when idle).
        ``light``: the step leaves the GPU bound by memory bandwidth (decode); until the next call the
        reserve is then refilled only below what light steps take, and trimmed only above
        ``reserve_max_pages`` (:mod:`elastic_kv.ledger.reserve`).

        Collects background maps, applies ``kvctl`` changes seen in the shared record (limit, trim: the
        reserve is returned and not refilled until the pool allocates again; either is published at once,
        as the pool's answer to ``kvctl``), refreshes the physical headroom (driver free memory, at most
        every ``free_memory_ttl_s``), sizes the reserve from recent growth and refills or trims it, and
        publishes a snapshot.
        """
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        if self._book.inflight:
            self._take_in()
        events = self._phys.poll()
        if events is not None:
            if events.limit_changed:  # the pool limit or the GPU-wide budget
                self._drain.apply_limit(self._phys.record_limit())
                self._follow_ceiling()
            if events.trim_requested:
                self._backing.unmap_reserve(0)
                self._trimmed = True  # not refilled by idle calls (an idle SGLang calls every pass)
        self._phys.refresh(force=events is not None and events.limit_changed)
        self._drain.follow(publish=False)
        over = self._phys.over_limit()
        if not over:
            self._policy.end_interval(light)
        self._light = light and not over
        target = 0 if over else self._reserve_goal()
        # Light steps keep what the heavy steps left (the reserve module), up to the cap: background maps
        # that land after their pages' demand was met can take the reserve above it.
        ceiling = self._cfg.reserve_max_pages if self._light else target
        book = self._book
        if len(book.reserve) > ceiling:
            self._backing.unmap_reserve(ceiling)
        if not self._trimmed and self._cfg.premap and len(book.reserve) + book.inflight_pages < target:
            if self._async:
                self._backing.refill_async(target - len(book.reserve) - book.inflight_pages)
            else:
                self._backing.refill_sync(target - len(book.reserve))
        answer = events is not None and (events.trim_requested or events.limit_changed)
        if answer or over != self._drain.shown_over:
            self._phys.publish_now(self._drain.published())  # kvctl waits for the pool's answer
        else:
            self._phys.publish(self._drain.published)

    def _reserve_goal(self) -> int:
        """Pages the reserve aims at: the policy's target, or its light target after a light step."""
        return self._policy.light_target if self._light else self._policy.target

    def expect(self, blocks: int) -> int:
        """The engine will soon allocate about ``blocks`` blocks that it has not asked for yet (requests
        arrived, their prompts not scheduled): queue background maps now, so that the backed free blocks
        and the pages in flight cover them. The driver then works while the engine takes in the rest of
        a batch and schedules it, instead of while the first step waits. Returns the pages queued, one
        background job each, so that an allocation waits only for the pages it needs (:meth:`_grow`).

        Bounded like the reserve: at most ``reserve_max_pages`` backed empty pages and pages in flight,
        within the physical headroom (limit, shared budget). The expectation counts as demand for the
        reserve's sizing (:meth:`ReservePolicy.note_expected`), so :meth:`maintain` keeps these pages
        until the engine's next steps use them; an overestimate is trimmed once ``reserve_window`` steps
        pass without such demand. Does nothing without an asynchronous mapper, with ``premap`` off, or
        while the pool is over its limit. ``ValueError`` if ``blocks < 0``.
        """
        book = self._book
        if blocks <= book.free_backed:
            if blocks < 0:
                raise ValueError(f"cannot expect {blocks} blocks")
            return 0
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        if not (self._async and self._cfg.premap):
            return 0
        pages = -(-(blocks - book.free_backed) // book.bpp)
        self._policy.note_expected(pages)
        room = self._cfg.reserve_max_pages - len(book.reserve) - book.inflight_pages
        want = min(pages - book.inflight_pages, room)
        if want <= 0:
            return 0
        return self._backing.queue_each(want)

    def _take_in(self, wait: bool = False, jobs: int = 0) -> None:
        """Collect finished background maps (:meth:`PageBacking.collect`); if the limit was lowered while
        they were in flight, the pages that landed go straight back."""
        self._backing.collect(wait, jobs)
        if self._phys.over_limit():
            self._backing.unmap_reserve(0)

    def settle(self) -> None:
        """Wait for every background map queued so far and take it in (its pages join the reserve).

        Engines call it before sleeping or tearing a pool down; tests call it to make a pool's state
        independent of the background thread's timing."""
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        if self._book.inflight:
            self._take_in(wait=True)

    # -- limits -----------------------------------------------------------------------------------------

    def resize(self, limit_bytes: int) -> None:
        """Follow a new physical limit (0 = none). Raising it lets the pool grow at once (and ends a drain).
        Lowering it stops new pages beyond the limit, unmaps reserve pages now, chooses pages in use to
        drain (:mod:`elastic_kv.ledger.drain`), unmaps pages as they empty, and completes as live blocks
        drain; a page with live blocks is never unmapped. ``ValueError`` if negative."""
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes={limit_bytes} must be >= 0 (0 = no limit)")
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        self._drain.apply_limit(limit_bytes)
        self._follow_ceiling()

    def trim(self, keep: int = 0) -> int:
        """Unmap reserve pages now, all but the ``keep`` most recently added; returns how many were
        unmapped. Pages pending release stay until their epoch is released. ``ValueError`` if ``keep < 0``.
        ``keep=0`` (an engine that sleeps or resets its cache) returns the whole reserve as ``kvctl trim``
        does: :meth:`maintain` does not map it again until the pool allocates."""
        if keep < 0:
            raise ValueError(f"keep={keep} must be >= 0")
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        if keep == 0:
            self._trimmed = True
        return self._backing.unmap_reserve(keep)

    def clear(self) -> None:
        """Free every live block but the null block (engine reset), then unmap the reserve. With
        ``defer_release`` the emptied pages still wait for ``release_through``."""
        if get_ident() != self._guard.owner:
            self._guard.refuse()
        live = self._book.issued_blocks()
        emptied = self._book.return_blocks(live) if live else []
        if emptied:
            self._release.retire(emptied, self._epoch)
        self._backing.unmap_reserve(0)

    def close(self) -> None:
        """Unmap every page (the null block's too) and return the charge. The pool is unusable after;
        idempotent. Only call it when no GPU work can touch the pool any more."""
        if get_ident() != self._guard.thread:
            self._guard.check_thread()
        if self._guard.closed:
            return
        if self._guard.broken is None:
            if self._book.inflight:
                self._take_in(wait=True)
            backed = self.mapped_pages()
            if backed:
                self._backing.unmap_now(backed, closing=True)
        self._guard.close()

    # -- snapshot ---------------------------------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        """The pool's statistics now."""
        return self._snapshot()

    def publish(self) -> None:
        """Publish the pool's statistics to its records now (``kvctl``), outside :meth:`maintain`'s
        schedule; nothing without a record. Any thread, like :meth:`snapshot`."""
        if self._phys.shares:
            self._phys.publish_now(self._drain.published())

    def _snapshot(self) -> PoolSnapshot:
        return pool_snapshot(
            self._guard,
            self._book,
            self._phys,
            has_null=self._null is not None,
            available_blocks=self.available_size(),
            hits=self._hits,
            misses=self._misses,
            epoch=self._epoch,
            preemptions=self._drain.preemptions,
            largest_request_bytes=self.bytes_for_blocks(self._largest_request),
            failed_requests=self._failed,
        )
