"""The ledger: which KV blocks are live, and so which logical pages must be backed.

:class:`KVCacheManager` issues block ids to an engine and decides, page by page, when physical memory is
needed. It is the single owner of "which page is backed": the data plane (through a
:class:`~elastic_kv.mapper.PageMapper`) only executes its decisions, and the shared record
(``elastic_kv.registry.PoolRecord``) is charged for every byte before it is backed.

Page life cycle (``UNMAPPED`` -> ``USED`` <-> ``RESERVE`` / ``PENDING`` -> ``UNMAPPED``)::

    UNMAPPED --map (sync) or map_async + collect--> RESERVE --alloc--> USED (>= 1 live block)
    USED --last block freed--> RESERVE (room under the cap)   | PENDING (defer_release) | UNMAPPED
    PENDING --release_through(epoch)--> RESERVE | UNMAPPED;   PENDING --alloc--> USED (reuse is safe:
    only *unmapping* must wait for the GPU, reusing a backed page never does)
    USED (draining) --last block freed--> WITHHELD --release_through(epoch)--> UNMAPPED

Limits: when the limit drops below what the pool holds, the reserve is unmapped at once and the ledger
chooses pages in use to *drain* (:meth:`KVCacheManager.draining_pages`): enough of them that releasing
them gets the pool under the limit, in the engine's order of preference (``drain_order``: the fewest
requests to preempt), else fewest live blocks first. A draining page issues no block
again, so the blocks freed on it -- by requests finishing, or by the engine preempting the requests
that hold them (vLLM) or retracting them -- are not handed to other requests, and the page is unmapped
once empty. The pool is ``SHRINKING`` until its charge fits; the first snapshot published after that
says so, and a limit lifted or raised above the charge ends the drain at once.

Allocation is page-affine so that few pages stay backed: a request is served first from pages that are
already backed and partly used (the smallest one that holds the whole run, else the one with the most
free blocks -- kvcached's rule), then from backed empty pages (pending release, then the pre-mapped
reserve), and only then by mapping new pages. Backed empty pages come after partly used ones because
taking a fresh page while a partial one has room would leave two pages half full instead of one full.

The data structures (O(1) best fit, per-page free stacks) are in :mod:`elastic_kv.pagebook`; the
physical accounting (limit, shared record, cached headroom) in :mod:`elastic_kv.physical`; the reserve's
sizing in :mod:`elastic_kv.reserve`.

Epochs (``defer_release``): the engine calls :meth:`KVCacheManager.advance_epoch` when it launches GPU
work and :meth:`KVCacheManager.release_through` with that epoch once the work finished. A page emptied
while epoch ``e`` is current is unmapped only after ``release_through(e)``: GPU work queued before the free
may still read or write it (kvcached #463), and unmapping under a running kernel is a fault that kills
the CUDA context.

Threading: a pool has one owner thread, the engine's scheduling thread (vLLM's engine-core loop, SGLang's
scheduler); every method that changes the pool raises ``RuntimeError`` when called from another thread
(one ``get_ident()`` comparison, which is also the closed/inconsistent check: far cheaper than a lock on a
path that runs per scheduled request). :meth:`bind_thread` hands the pool to another thread.
:meth:`snapshot`, :meth:`available_size` and the read-only properties may be called from any thread: they
only read (under the GIL), so a reader sees numbers at most one operation old. ``kvctl`` changes reach the
pool through its shared record and are applied by :meth:`maintain`, on the owner thread. The data plane's
background mapping thread never calls into Python; its results are picked up by :meth:`maintain` and
``alloc``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from threading import get_ident
from typing import TYPE_CHECKING

from elastic_kv.backing import PageBacking
from elastic_kv.config import ElasticConfig
from elastic_kv.errors import PoolExhausted
from elastic_kv.geometry import BlockGeometry
from elastic_kv.mapper import PageMapper
from elastic_kv.pagebook import PENDING, RESERVE, USED, WITHHELD
from elastic_kv.physical import PhysicalAccount
from elastic_kv.reserve import ReservePolicy
from elastic_kv.snapshot import PoolSnapshot, PoolState

if TYPE_CHECKING:
    from elastic_kv.registry import DeviceShare, PoolRecord

__all__ = ["KVCacheManager"]

logger = logging.getLogger(__name__)


class KVCacheManager(PageBacking):
    """Block ids for one engine KV pool, backed page by page (see the module docstring).

    Args:
        geometry: the engine's layout (blocks, pages, extents); the mapper's pages are its pages.
        mapper: backs and releases pages (``LocalMapper`` over a ``_vmm.SpaceGroup``, or the ranks'
            coordinator). If it is an :class:`~elastic_kv.mapper.AsyncPageMapper`, the reserve is refilled
            in the background.
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

    Raises:
        PoolExhausted: the null block's page cannot be backed.
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
    ) -> None:
        cfg = config or ElasticConfig()
        if shares and record is not None:
            raise ValueError("pass either record or shares, not both")
        phys = PhysicalAccount(cfg, record, physical_free, clock, shares)
        super().__init__(geometry, mapper, phys, name)
        nb, bpp = self._nb, self._bpp
        self._cfg = cfg
        self._epoch = 0
        self._hits = 0
        self._misses = 0
        self._policy = ReservePolicy(cfg.reserve_min_pages, cfg.reserve_max_pages, cfg.reserve_window)
        self._light = False  # the last maintain() was for a light step
        self._preemptions = 0  # requests the engine preempted (note_preempted)
        self._shown_over = False  # the last snapshot published said "shrinking"
        # The engine's order of preference among pages to drain: called (on the owner thread) with the
        # candidate pages, fewest live blocks first, it returns them best first; pages it leaves out or
        # invents are ignored (see _plan_drain). None: the candidates' own order.
        self.drain_order: Callable[[list[int]], list[int]] | None = None

        self._null = null_block
        if null_block is not None:
            if not 0 <= null_block < nb:
                raise ValueError(f"null_block={null_block} outside 0..{nb - 1}")
            page = null_block // bpp
            self._unmapped.remove(page)
            self._unmapped_blocks -= self._cap(page)
            self._map_now([page])
            self._page_free[page] = [b for b in reversed(geometry.blocks_of(page)) if b != null_block]
            self._page_state[page] = USED
            self._live[null_block] = 2  # live, and never accepted by free()
            self._free_backed = len(self._page_free[page])
            self._rebucket(page)
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
        return self._live_count() - (self._null is not None)

    def over_limit(self) -> bool:
        """True while the pool holds more than its limit (``kvctl limit`` lowered it below what is backed):
        it is shrinking. Its draining pages (:meth:`draining_pages`) issue no block, and memory comes back
        as the blocks on them are freed."""
        return self._phys.over_limit()

    @property
    def preemptions(self) -> int:
        """Requests the engine preempted since the pool started (:meth:`note_preempted`)."""
        return self._preemptions

    def note_preempted(self, requests: int = 1) -> None:
        """The engine preempted ``requests`` requests (their blocks freed, to be recomputed): counted in
        the snapshot, where ``kvctl limit --wait`` reads what applying a limit cost. Called on the
        engine's scheduling thread, like every counter of the pool."""
        self._preemptions += requests

    @property
    def free_backed_blocks(self) -> int:
        """Free blocks on backed pages (partly used, reserve, pending): what ``alloc`` serves without a
        driver call. O(1), no lock (a single int read); engines use it to decide whether an allocation
        can be made without mapping."""
        return self._free_backed

    @property
    def reserve_hit_rate(self) -> float:
        """Fraction of new pages served already mapped (from the reserve or pending pages) rather than
        mapped on the allocating thread; 1.0 before any."""
        total = self._hits + self._misses
        return 1.0 if total == 0 else self._hits / total

    def available_size(self) -> int:
        """Blocks an ``alloc`` could get now: free blocks on backed pages plus pages in flight, plus as many
        unbacked pages as the physical headroom (limit, shared record, driver free memory) can back.

        O(1), no driver or shared-memory access. A hint, like vLLM's ``get_num_free_blocks``: another pool
        may take the GPU-wide budget first, so ``alloc`` may still answer ``None``.
        """
        room = self._phys.room()
        page_bytes = self._geo.page_bytes
        pages = room // page_bytes if page_bytes else 0
        return (
            self._free_backed
            + self._inflight_pages * self._bpp
            + min(self._unmapped_blocks, pages * self._bpp)
        )

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
        if get_ident() != self._owner:
            self._refuse()
        mask = self._mask
        fit = mask >> n
        if fit:
            # Fast path (a decode step, most prefills): one partly used page holds the whole run; the
            # smallest such page is the lowest set bit of the bucket mask at or above n.
            k = n + ((fit & -fit).bit_length() - 1)
            bucket = self._buckets[k]
            page, _ = bucket.popitem()
            if not bucket:
                mask ^= 1 << k
            free = self._page_free[page]
            rest = k - n
            self._page_bucket[page] = rest
            if rest:
                self._buckets[rest][page] = None
                mask |= 1 << rest
            self._mask = mask
            self._free_backed -= n
            live = self._live
            if n == 1:  # a decode step's block: one pop, no slices
                block = free.pop()
                live[block] = 1
                return [block]
            out = free[-n:]
            del free[-n:]
            for block in out:
                live[block] = 1
            return out
        return self._alloc_pages(n)

    def _alloc_pages(self, n: int) -> list[int] | None:
        """``alloc`` when no single partly used page holds the run: take in finished background maps,
        grow if the backed pages are still short, then take. Empty pages that were backed before the call
        (reserve, pending, background maps already done) count as reserve hits; pages this call had to
        wait for or map count as misses."""
        if n > self._free_backed and self._inflight:
            self._take_in()
        ready = len(self._reserve) + len(self._pending_epoch)
        if n > self._free_backed and not self._grow(n):
            return None
        out, acquired = self._take_blocks(n)
        if acquired:
            missed = max(0, acquired - ready)
            self._misses += missed
            self._hits += acquired - missed
            self._policy.note_acquired(acquired)
            if self._async and self._cfg.premap:
                self._refill_async(self._reserve_goal() - len(self._reserve) - self._inflight_pages)
        return out

    def _grow(self, n: int) -> bool:
        """Make ``_free_backed >= n``: wait for the background maps that cover the shortfall (the oldest
        first: they finish first; the rest keep landing while the engine runs), then -- only if those
        failed -- for all of them (a synchronous map would queue behind them in the driver anyway), and
        map what is still missing. False -- with nothing changed but pages that landed -- when the pool
        cannot grow that much."""
        if self._inflight:
            self._take_in(wait=True, jobs=self._jobs_covering(n - self._free_backed))
            if n > self._free_backed and self._inflight:
                self._take_in(wait=True)
        short = n - self._free_backed
        if short <= 0:
            return True
        if short > self._unmapped_blocks or self._phys.over_limit():
            return False  # too few blocks, or shrinking: no new pages until live blocks drain
        pages: list[int] = []
        capacity = 0
        while capacity < short:
            pages.append(self._pop_unmapped())
            capacity += self._cap(pages[-1])
        try:
            self._map_now(pages)
        except PoolExhausted:
            self._unpop_unmapped(pages)
            return False
        except BaseException:
            self._unpop_unmapped(pages)  # a driver error after the data plane's rollback: nothing changed
            raise
        for page in pages:
            self._page_to_reserve(page)
        return True

    def free(self, ids: Iterable[int]) -> None:
        """Return live blocks. Pages that empty go to the reserve (up to its cap), wait for
        :meth:`release_through` (``defer_release``), or are unmapped.

        ``ids`` must be Python ints. ``ValueError`` with nothing changed if an id is out of range, not live
        (double free, never issued, another pool's id), repeated, or the null block.
        """
        blocks = ids if type(ids) is list else list(ids)
        if not blocks:
            return
        if get_ident() != self._owner:
            self._refuse()
        live, nb = self._live, self._nb
        for b in blocks:
            # live[b] is 1 for an issued block, 0 for a free one, 2 for the null block
            if type(b) is not int or not 0 <= b < nb or live[b] != 1:
                raise ValueError(self._bad_id_message(blocks))
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):
            raise ValueError(self._bad_id_message(blocks))
        emptied = self._return_blocks(blocks)
        if emptied:
            self._retire(emptied)

    def _bad_id_message(self, blocks: Sequence[int]) -> str:
        seen: set[int] = set()
        for b in blocks:
            if type(b) is not int:
                return f"block id {b!r} is not an int"
            if not 0 <= b < self._nb:
                return f"block id {b} outside this pool's 0..{self._nb - 1}"
            if b == self._null:
                return f"block {b} is the null block; it is never freed"
            if b in seen:
                return f"block {b} appears twice in one free()"
            if not self._live[b]:
                return f"block {b} is not live (double free, or an id this pool never issued)"
            seen.add(b)
        raise AssertionError("no bad id")  # pragma: no cover

    def _retire(self, pages: list[int]) -> None:
        """Pages just emptied: defer behind the epoch, keep in the reserve, or unmap; a draining page is
        never kept or reused, only unmapped (after its epoch with ``defer_release``)."""
        if self._drain_count:
            drain = self._draining
            drained = [p for p in pages if drain[p]]
            if drained:
                pages = [p for p in pages if not drain[p]]
                self._retire_drained(drained)
        if self._cfg.defer_release:
            for p in pages:
                self._page_state[p] = PENDING
                self._pending_epoch[p] = self._epoch
                self._pending.append((self._epoch, p))
        else:
            self._release_empty(pages)
        if self._drain_count or self._shown_over:
            self._follow_limit()  # the drain ends, and readers learn it, once within the limit

    def _retire_drained(self, pages: list[int]) -> None:
        if not self._cfg.defer_release:
            self._unmap_now(pages)
            return
        for p in pages:
            self._page_state[p] = WITHHELD
            self._withheld_epoch[p] = self._epoch
            self._pending.append((self._epoch, p))

    def _release_empty(self, pages: list[int]) -> None:
        """Empty backed pages that may be unmapped now: to the reserve while it is under its cap and the
        pool is within its limit, the rest unmapped in one data-plane transaction."""
        unmap: list[int] = []
        cap = self._cfg.reserve_max_pages
        for p in pages:
            if len(self._reserve) < cap and not self._phys.over_limit():
                self._page_state[p] = RESERVE
                self._reserve.append(p)
            else:
                unmap.append(p)
        if unmap:
            self._unmap_now(unmap)

    # -- epochs -----------------------------------------------------------------------------------------

    def advance_epoch(self) -> int:
        """Start a new release epoch and return its number. Call it when the engine launches GPU work that
        may touch blocks freed later; pages emptied from now on wait for ``release_through`` of this
        epoch (or a later one) before they can be unmapped."""
        if get_ident() != self._owner:
            self._refuse()
        self._epoch += 1
        return self._epoch

    def release_through(self, epoch: int) -> int:
        """The engine's GPU work launched up to ``epoch`` has finished: pages emptied in epochs <= ``epoch``
        may be unmapped now (or kept in the reserve). Returns how many pages left the pending state."""
        if get_ident() != self._owner:
            self._refuse()
        ready: list[int] = []
        drained: list[int] = []
        while self._pending and self._pending[0][0] <= epoch:
            e, p = self._pending.popleft()
            if self._pending_epoch.get(p) == e:  # else: reused since, or emptied again later
                del self._pending_epoch[p]
                ready.append(p)
            elif self._withheld_epoch.get(p) == e:
                drained.append(p)
        if drained:
            self._unmap_now(drained)
        if ready:
            self._release_empty(ready)
        if drained or (ready and (self._drain_count or self._shown_over)):
            self._follow_limit()
        return len(ready) + len(drained)

    # -- background pre-mapping -------------------------------------------------------------------------

    def maintain(self, light: bool = False) -> None:
        """Housekeeping; call once per engine step, after the step's allocations (cheap when idle).
        ``light``: the step leaves the GPU bound by memory bandwidth (decode); until the next call the
        reserve is then refilled only below what light steps take, and trimmed only above
        ``reserve_max_pages`` (:mod:`elastic_kv.reserve`).

        Collects background maps, applies ``kvctl`` changes seen in the shared record (limit, trim: the
        reserve is returned and not refilled in the same call; either is published at once, as the
        pool's answer to ``kvctl``), refreshes the physical headroom (driver free memory, at most every
        ``free_memory_ttl_s``), sizes the reserve from recent growth and refills or trims it, and publishes
        a snapshot.
        """
        if get_ident() != self._owner:
            self._refuse()
        if self._inflight:
            self._take_in()
        events = self._phys.poll()
        trimmed = False
        if events is not None:
            if events.limit_changed:  # the pool limit or the GPU-wide budget
                self._apply_limit(self._phys.record_limit())
            if events.trim_requested:
                self._trim_reserve(0)
                trimmed = True  # returned now: not refilled by this call (the next steps' demand may)
        self._phys.refresh(force=events is not None and events.limit_changed)
        self._follow_limit(publish=False)
        over = self._phys.over_limit()
        if not over:
            self._policy.end_interval(light)
        self._light = light and not over
        target = 0 if over else self._reserve_goal()
        # Light steps keep what the heavy steps left (the reserve module), up to the cap: background maps
        # that land after their pages' demand was met can take the reserve above it.
        ceiling = self._cfg.reserve_max_pages if self._light else target
        if len(self._reserve) > ceiling:
            self._trim_reserve(ceiling)
        if not trimmed and self._cfg.premap and len(self._reserve) + self._inflight_pages < target:
            if self._async:
                self._refill_async(target - len(self._reserve) - self._inflight_pages)
            else:
                self._refill_sync(target - len(self._reserve))
        answer = events is not None and (events.trim_requested or events.limit_changed)
        if answer or over != self._shown_over:
            self._phys.publish_now(self._published())  # kvctl waits for the pool's answer
        else:
            self._phys.publish(self._published)

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
        if blocks <= self._free_backed:
            if blocks < 0:
                raise ValueError(f"cannot expect {blocks} blocks")
            return 0
        if get_ident() != self._owner:
            self._refuse()
        if not (self._async and self._cfg.premap):
            return 0
        pages = -(-(blocks - self._free_backed) // self._bpp)
        self._policy.note_expected(pages)
        room = self._cfg.reserve_max_pages - len(self._reserve) - self._inflight_pages
        want = min(pages - self._inflight_pages, room)
        if want <= 0:
            return 0
        before = self._inflight_pages
        for _ in range(want):
            queued = self._inflight_pages
            self._refill_async(1)
            if self._inflight_pages == queued:
                break  # no headroom left
        return self._inflight_pages - before

    def _jobs_covering(self, blocks: int) -> int:
        """How many of the oldest background maps in flight hold ``blocks`` blocks (0: all of them)."""
        for count, pages in enumerate(self._inflight.values(), 1):
            blocks -= sum(self._cap(p) for p in pages)
            if blocks <= 0:
                return count
        return 0

    def _take_in(self, wait: bool = False, jobs: int = 0) -> None:
        """Collect finished background maps (see :meth:`_collect`); if the limit was lowered while they
        were in flight, the pages that landed go straight back."""
        self._collect(wait, jobs)
        if self._phys.over_limit():
            self._trim_reserve(0)

    def settle(self) -> None:
        """Wait for every background map queued so far and take it in (its pages join the reserve).

        Engines call it before sleeping or tearing a pool down; tests call it to make a pool's state
        independent of the background thread's timing."""
        if get_ident() != self._owner:
            self._refuse()
        if self._inflight:
            self._take_in(wait=True)

    # -- limits -----------------------------------------------------------------------------------------

    def resize(self, limit_bytes: int) -> None:
        """Follow a new physical limit (0 = none). Raising it lets the pool grow at once. Lowering it stops
        new pages beyond the limit, unmaps reserve pages now, unmaps pages as they empty, and completes as
        live blocks drain; a page with live blocks is never unmapped. ``ValueError`` if negative."""
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes={limit_bytes} must be >= 0 (0 = no limit)")
        if get_ident() != self._owner:
            self._refuse()
        self._apply_limit(limit_bytes)

    def _apply_limit(self, limit_bytes: int) -> None:
        self._phys.limit = limit_bytes
        if self._phys.over_limit():
            self._trim_reserve(0)
            phys = self._phys
            logger.info("pool %s shrinking: %d bytes backed, limit %d", self._name, phys.charged, phys.limit)
        self._follow_limit(publish=False)

    def _follow_limit(self, publish: bool = True) -> None:
        """Keep the drain matched to the limit: over it, enough pages draining to get under it
        (:meth:`_plan_drain`); under it (pages were released, or the limit was lifted or raised), none --
        and with ``publish``, readers learn at once that the pool stopped shrinking."""
        if self._phys.over_limit():
            self._plan_drain()
        else:
            if self._drain_count:
                for p in self.mapped_pages():
                    self._unwithhold(p)
            if publish and self._shown_over and self._phys.shares:
                self._phys.publish_now(self._published())

    def _plan_drain(self) -> None:
        """Choose pages to release until what the pool is returning covers its excess over the limit:
        empty backed pages and pages in flight go anyway (they are unmapped while the pool is over its
        limit); beyond those, pages in use in the engine's order (:attr:`drain_order`: an engine that knows
        which request holds which block orders them so that the fewest requests must be preempted), else
        those with the fewest live blocks, most recently mapped first among equals. A chosen page issues
        no block from now on and is unmapped once its last block is freed. The null block's page is never
        chosen. Counts whole pages (``page_bytes``): where pages share slots, or an empty page counted as
        leaving is reused instead, the next call tops the drain up."""
        phys, page_bytes = self._phys, self._geo.page_bytes
        excess = phys.charged - phys.limit
        leaving = len(self._reserve) + len(self._pending_epoch) + self._inflight_pages + self._drain_count
        short = excess - leaving * page_bytes
        if short <= 0 or not page_bytes:
            return
        st, drain = self._page_state, self._draining
        null_page = -1 if self._null is None else self._null // self._bpp
        candidates = [p for p in range(self._npages) if st[p] == USED and not drain[p] and p != null_page]
        candidates.sort(key=lambda p: (self.live_blocks_on(p), -p))
        if self.drain_order is not None:
            allowed = set(candidates)
            preferred = list(dict.fromkeys(p for p in self.drain_order(candidates) if p in allowed))
            taken = set(preferred)
            candidates = preferred + [p for p in candidates if p not in taken]
        for p in candidates[: -(-short // page_bytes)]:
            self._withhold(p)
        logger.info("pool %s over its limit: %d page(s) draining", self._name, self._drain_count)

    def trim(self, keep: int = 0) -> int:
        """Unmap reserve pages now, all but the ``keep`` most recently added; returns how many were
        unmapped. Pages pending release stay until their epoch is released. ``ValueError`` if ``keep < 0``."""
        if keep < 0:
            raise ValueError(f"keep={keep} must be >= 0")
        if get_ident() != self._owner:
            self._refuse()
        return self._trim_reserve(keep)

    def _trim_reserve(self, keep: int) -> int:
        excess = len(self._reserve) - keep
        if excess <= 0:
            return 0
        pages = self._reserve[:excess]  # the oldest reserve pages go first
        del self._reserve[:excess]
        self._unmap_now(pages)
        return len(pages)

    def clear(self) -> None:
        """Free every live block but the null block (engine reset), then unmap the reserve. With
        ``defer_release`` the emptied pages still wait for ``release_through``."""
        if get_ident() != self._owner:
            self._refuse()
        live = [b for b in range(self._nb) if self._live[b] == 1]  # (the null block is 2)
        emptied = self._return_blocks(live) if live else []
        if emptied:
            self._retire(emptied)
        self._trim_reserve(0)

    def close(self) -> None:
        """Unmap every page (the null block's too) and return the charge. The pool is unusable after;
        idempotent. Only call it when no GPU work can touch the pool any more."""
        if get_ident() != self._thread:
            self._check_thread()
        if self._closed:
            return
        if self._broken is None:
            if self._inflight:
                self._take_in(wait=True)
            backed = self.mapped_pages()
            if backed:
                self._unmap_now(backed, closing=True)
        self._closed = True
        self._owner = -1

    # -- snapshot ---------------------------------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        """The pool's statistics now."""
        return self._snapshot()

    def publish(self) -> None:
        """Publish the pool's statistics to its records now (``kvctl``), outside :meth:`maintain`'s
        schedule; nothing without a record. Any thread, like :meth:`snapshot`."""
        if self._phys.shares:
            self._phys.publish_now(self._published())

    def _published(self) -> PoolSnapshot:
        """A snapshot about to be published; remembers whether it says "shrinking"."""
        snap = self._snapshot()
        self._shown_over = snap.state is PoolState.SHRINKING
        return snap

    def _snapshot(self) -> PoolSnapshot:
        if self._closed:
            state = PoolState.CLOSED
        elif self._broken is not None:
            state = PoolState.INCONSISTENT
        elif self._phys.over_limit():
            state = PoolState.SHRINKING
        else:
            state = PoolState.ACTIVE
        has_null = self._null is not None
        return PoolSnapshot(
            name=self._name,
            state=state,
            block_size_bytes=self._geo.block_bytes,
            page_size=self._geo.page_size,
            page_bytes=self._geo.page_bytes,
            blocks_per_page=self._bpp,
            total_blocks=self._nb,
            used_blocks=self._live_count() - has_null,
            free_blocks=self._nb - self._live_count(),
            available_blocks=self.available_size(),
            total_pages=self._npages,
            mapped_pages=self._npages - len(self._unmapped) - self._inflight_pages,
            reserve_pages=len(self._reserve),
            pending_pages=len(self._pending_epoch),
            inflight_pages=self._inflight_pages,
            mapped_bytes=self._phys.charged,
            limit_bytes=self._phys.limit,
            reserve_hits=self._hits,
            reserve_misses=self._misses,
            epoch=self._epoch,
            timestamp=time.time(),
            preemptions=self._preemptions,
            draining_pages=self._drain_count,
        )
