"""The ledger: which KV blocks are live, and so which logical pages must be backed.

:class:`KVCacheManager` issues block ids to an engine and decides, page by page, when physical memory is
needed. It is the single owner of "which page is backed": the data plane (through a
:class:`~elastic_kv.mapper.PageMapper`) only executes its decisions, and the shared record
(``elastic_kv.registry.PoolRecord``) is charged for every byte before it is backed.

Page life cycle (``_UNMAPPED`` -> ``_USED`` <-> ``_RESERVE`` / ``_PENDING`` -> ``_UNMAPPED``)::

    UNMAPPED --map (sync) or map_async + collect--> RESERVE --alloc--> USED (>= 1 live block)
    USED --last block freed--> RESERVE (room under the cap)   | PENDING (defer_release) | UNMAPPED
    PENDING --release_through(epoch)--> RESERVE | UNMAPPED;   PENDING --alloc--> USED (reuse is safe:
    only *unmapping* must wait for the GPU, reusing a backed page never does)

Allocation is page-affine so that few pages stay backed: a request is served first from pages that are
already backed and partly used (the smallest one that holds the whole run, else the one with the most
free blocks -- kvcached's rule), then from backed empty pages (pending release, then the pre-mapped
reserve), and only then by mapping new pages. Backed empty pages come after partly used ones because
taking a fresh page while a partial one has room would leave two pages half full instead of one full.

Data structures (chosen for the per-block cost on the engine's scheduling thread):

* ``_live``: a ``bytearray`` over block ids -- O(1) double-free / foreign-id checks;
* ``_page_free[p]``: the free block ids of each backed page, a list used as a stack (``alloc`` slices
  blocks off its end, ``free`` appends), so serving ``n`` blocks from a page is one slice;
* ``_buckets[k]``: the partly used pages with exactly ``k`` free blocks, plus a bit mask of non-empty
  buckets: best fit ("smallest page holding ``n``") is one shift and one lowest-set-bit, O(1);
* ``_reserve`` / ``_pending`` / ``_unmapped``: stacks and a queue of page ids.

Threading: engines drive a pool from one thread (vLLM's scheduler, SGLang's scheduler process). Every
public method still takes ``self._lock`` (uncontended: tens of nanoseconds), so a metrics exporter or a
control thread may call :meth:`snapshot`, :meth:`trim` or :meth:`resize` safely. The data plane's
background mapping thread never calls into Python; its results are picked up by :meth:`maintain` and
``alloc``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from elastic_kv.config import ElasticConfig
from elastic_kv.errors import PoolExhausted, StateConsistencyError
from elastic_kv.geometry import BlockGeometry
from elastic_kv.mapper import AsyncPageMapper, PageMapper
from elastic_kv.reserve import ReservePolicy
from elastic_kv.snapshot import PoolSnapshot, PoolState

if TYPE_CHECKING:
    from elastic_kv.registry import PoolRecord

__all__ = ["KVCacheManager"]

logger = logging.getLogger(__name__)

# Page states (one byte per page in _page_state).
_UNMAPPED, _USED, _RESERVE, _PENDING, _INFLIGHT = 0, 1, 2, 3, 4
_STATE_NAMES = ("unmapped", "used", "reserve", "pending", "inflight")

# How long alloc waits for pages already being mapped in the background before it gives up on them.
_INFLIGHT_WAIT_S = 2.0


class KVCacheManager:
    """Block ids for one engine KV pool, backed page by page (see the module docstring).

    Args:
        geometry: the engine's layout (blocks, pages, extents); the mapper's pages are its pages.
        mapper: backs and releases pages (``LocalMapper`` over a ``_vmm.SpaceGroup``, or the ranks'
            coordinator). If it is an :class:`~elastic_kv.mapper.AsyncPageMapper`, the reserve is refilled
            in the background.
        config: reserve watermarks, deferred release, limit, ...
        record: the pool's shared record (limit, GPU-wide budget, statistics); ``None`` = no sharing.
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
    ) -> None:
        self._geo = geometry
        self._mapper = mapper
        self._async = isinstance(mapper, AsyncPageMapper)
        self._cfg = config or ElasticConfig()
        self._record = record
        self._name = name
        self._physical_free = physical_free
        self._clock = clock
        self._lock = threading.Lock()

        nb, bpp, npages = geometry.num_blocks, geometry.blocks_per_page, geometry.num_pages
        self._nb, self._bpp, self._npages = nb, bpp, npages
        self._last_cap = nb - (npages - 1) * bpp  # blocks on the last page
        self._live = bytearray(nb)
        self._page_state = bytearray(npages)
        self._page_free: list[list[int]] = [[] for _ in range(npages)]
        self._page_bucket = [0] * npages  # the bucket a USED page is in (0 = none: full, or not USED)
        self._buckets: list[dict[int, None]] = [{} for _ in range(bpp + 1)]
        self._mask = 0  # bit k set <=> _buckets[k] is not empty
        self._reserve: list[int] = []
        self._pending: deque[tuple[int, int]] = deque()  # (epoch, page); stale entries are skipped
        self._pending_epoch: dict[int, int] = {}  # PENDING page -> epoch it emptied in
        self._unmapped = list(range(npages - 1, -1, -1))  # a stack: lowest page ids are mapped first
        self._inflight: dict[int, list[int]] = {}  # map_async job id -> its pages

        self._free_backed = 0  # free blocks on USED/RESERVE/PENDING pages
        self._unmapped_blocks = nb
        self._inflight_pages = 0
        self._used = 0  # live blocks, the null block included
        self._charged = 0  # physical bytes charged: slots of every backed or in-flight page, counted once
        self._epoch = 0
        self._limit = self._cfg.limit_bytes
        self._hits = 0
        self._misses = 0
        self._broken: str | None = None
        self._closed = False
        cfg = self._cfg
        self._policy = ReservePolicy(cfg.reserve_min_pages, cfg.reserve_max_pages, cfg.reserve_window)
        # Physical headroom from outside the pool (record: limit + GPU-wide budget; driver free memory),
        # read in maintain() and corrected by our own charges since, so alloc never asks the driver.
        self._outside_room = 1 << 62
        self._charged_at_read = 0
        self._room_read_at = float("-inf")
        self._published_at = float("-inf")

        self._null = null_block
        if null_block is not None:
            if not 0 <= null_block < nb:
                raise ValueError(f"null_block={null_block} outside 0..{nb - 1}")
            page = null_block // bpp
            self._unmapped.remove(page)
            self._unmapped_blocks -= self._cap(page)
            self._map_now([page])
            self._page_free[page] = [b for b in reversed(geometry.blocks_of(page)) if b != null_block]
            self._page_state[page] = _USED
            self._live[null_block] = 1
            self._used = 1
            self._free_backed = len(self._page_free[page])
            self._rebucket(page)
        self._refresh_room(force=True)

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
        return self._charged

    @property
    def used_blocks(self) -> int:
        """Live blocks issued to the engine (the null block excluded)."""
        return self._used - (self._null is not None)

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

    def page_state(self, page: int) -> str:
        """``"unmapped" | "used" | "reserve" | "pending" | "inflight"`` (for tests and diagnostics)."""
        return _STATE_NAMES[self._page_state[page]]

    def is_live(self, block: int) -> bool:
        """Whether ``block`` is issued (the null block is always live)."""
        return bool(self._live[block])

    def mapped_pages(self) -> list[int]:
        """Pages the ledger holds backed (used, reserve, pending), ascending."""
        st = self._page_state
        return [p for p in range(self._npages) if st[p] in (_USED, _RESERVE, _PENDING)]

    def available_size(self) -> int:
        """Blocks an ``alloc`` could get now: free blocks on backed pages plus pages in flight, plus as many
        unbacked pages as the physical headroom (limit, shared record, driver free memory) can back.

        O(1), no driver or shared-memory access. A hint, like vLLM's ``get_num_free_blocks``: another pool
        may take the GPU-wide budget first, so ``alloc`` may still answer ``None``.
        """
        room = self._room_bytes()
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
        with self._lock:
            self._check_usable()
            grown = 0
            if n > self._free_backed:
                grown = self._grow(n)
                if grown < 0:
                    return None
            return self._take(n, grown)

    def _grow(self, n: int) -> int:
        """Make ``_free_backed >= n``: collect finished background maps, wait for running ones if they are
        needed, map the rest synchronously. Returns how many pages were backed on this thread's time
        (reserve misses), or -1 -- with nothing changed but collected pages -- when the pool cannot grow
        that much."""
        waited = 0
        if self._inflight:
            self._collect()
            if n > self._free_backed and self._inflight_pages:
                waited = self._inflight_pages
                self._await_inflight()
        short = n - self._free_backed
        if short <= 0:
            return waited
        if short > self._unmapped_blocks or self._over_limit():
            return -1  # too few blocks, or shrinking: no new pages until live blocks drain
        pages: list[int] = []
        capacity = 0
        while capacity < short:
            pages.append(self._pop_unmapped())
            capacity += self._cap(pages[-1])
        try:
            self._map_now(pages)
        except PoolExhausted:
            self._push_unmapped(pages)
            self._room_read_at = float("-inf")  # re-read the driver's free memory at the next maintain()
            return -1
        for page in pages:
            self._page_to_reserve(page)
        return waited + len(pages)

    def _take(self, n: int, grown: int) -> list[int]:
        """Serve ``n <= _free_backed`` blocks: partly used pages by best fit, then empty backed pages
        (pending release first: reusing one saves an unmap and a map; then the reserve). ``grown`` of the
        empty pages taken were backed on the allocating thread (misses); the others are reserve hits."""
        out: list[int] = []
        buckets, page_free = self._buckets, self._page_free
        left = n
        while left and self._mask:
            mask = self._mask
            fit = mask >> left
            # smallest bucket >= left (the page that holds the whole run), else the fullest free count
            k = left + ((fit & -fit).bit_length() - 1) if fit else mask.bit_length() - 1
            bucket = buckets[k]
            page, _ = bucket.popitem()
            if not bucket:
                self._mask = mask & ~(1 << k)
            take = k if k <= left else left
            free = page_free[page]
            out += free[-take:]
            del free[-take:]
            left -= take
            self._page_bucket[page] = 0
            if take < k:
                self._rebucket(page)
        acquired = 0
        while left:
            if self._pending_epoch:
                page, _ = self._pending_epoch.popitem()  # its queue entry goes stale
            else:
                page = self._reserve.pop()
            self._page_state[page] = _USED
            acquired += 1
            free = page_free[page]
            take = min(left, len(free))
            out += free[-take:]
            del free[-take:]
            left -= take
            if free:
                self._rebucket(page)
        live = self._live
        for b in out:
            live[b] = 1
        self._free_backed -= n
        self._used += n
        if acquired:
            self._policy.note_acquired(acquired)
            self._misses += grown
            self._hits += acquired - grown
            if self._async and self._cfg.premap:
                self._refill_async()
        return out

    def free(self, ids: Iterable[int]) -> None:
        """Return live blocks. Pages that empty go to the reserve (up to its cap), wait for
        :meth:`release_through` (``defer_release``), or are unmapped.

        ``ids`` must be Python ints. ``ValueError`` with nothing changed if an id is out of range, not live
        (double free, never issued, another pool's id), repeated, or the null block.
        """
        blocks = ids if isinstance(ids, (list, tuple)) else list(ids)
        if not blocks:
            return
        with self._lock:
            self._check_usable()
            self._free(blocks)

    def _free(self, blocks: Sequence[int]) -> None:
        live, nb, null = self._live, self._nb, self._null
        for i, b in enumerate(blocks):
            if type(b) is not int or not 0 <= b < nb or not live[b] or b == null:
                for undo in blocks[:i]:
                    live[undo] = 1
                raise ValueError(self._bad_id_message(blocks, i))
            live[b] = 0
        bpp, page_free = self._bpp, self._page_free
        touched: dict[int, None] = {}
        for b in blocks:
            p = b // bpp
            page_free[p].append(b)
            touched[p] = None
        self._free_backed += len(blocks)
        self._used -= len(blocks)
        emptied: list[int] = []
        for p in touched:
            self._unbucket(p)
            if len(page_free[p]) == self._cap(p):
                emptied.append(p)
            else:
                self._rebucket(p)
        if emptied:
            self._retire(emptied)

    def _bad_id_message(self, blocks: Sequence[int], i: int) -> str:
        b = blocks[i]
        if type(b) is not int:
            return f"block id {b!r} is not an int"
        if not 0 <= b < self._nb:
            return f"block id {b} outside this pool's 0..{self._nb - 1}"
        if b == self._null:
            return f"block {b} is the null block; it is never freed"
        if b in blocks[:i]:
            return f"block {b} appears twice in one free()"
        return f"block {b} is not live (double free, or an id this pool never issued)"

    def _retire(self, pages: list[int]) -> None:
        """Pages just emptied: defer behind the epoch, keep in the reserve, or unmap."""
        if self._cfg.defer_release:
            for p in pages:
                self._page_state[p] = _PENDING
                self._pending_epoch[p] = self._epoch
                self._pending.append((self._epoch, p))
            return
        self._settle(pages)

    def _settle(self, pages: list[int]) -> None:
        """Empty backed pages that may be unmapped now: to the reserve while it is under its cap and the
        pool is within its limit, the rest unmapped in one data-plane transaction."""
        unmap: list[int] = []
        cap = self._cfg.reserve_max_pages
        for p in pages:
            if len(self._reserve) < cap and not self._over_limit():
                self._page_state[p] = _RESERVE
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
        with self._lock:
            self._epoch += 1
            return self._epoch

    def release_through(self, epoch: int) -> int:
        """The engine's GPU work launched up to ``epoch`` has finished: pages emptied in epochs <= ``epoch``
        may be unmapped now (or kept in the reserve). Returns how many pages left the pending state."""
        with self._lock:
            self._check_usable()
            ready: list[int] = []
            while self._pending and self._pending[0][0] <= epoch:
                e, p = self._pending.popleft()
                if self._pending_epoch.get(p) == e:  # else: reused since, or emptied again later
                    del self._pending_epoch[p]
                    ready.append(p)
            if ready:
                self._settle(ready)
            return len(ready)

    # -- background pre-mapping -------------------------------------------------------------------------

    def maintain(self) -> None:
        """Housekeeping; call once per engine step, after the step's allocations (cheap when idle).

        Collects background maps, applies ``kvctl`` changes seen in the shared record (limit, trim),
        refreshes the physical headroom (driver free memory, at most every ``free_memory_ttl_s``), sizes
        the reserve from recent growth and refills or trims it, and publishes a snapshot.
        """
        with self._lock:
            self._check_usable()
            if self._inflight:
                self._collect()
            if self._record is not None:
                events = self._record.poll()
                if events.limit_changed:
                    self._apply_limit(self._record.limit_bytes)
                if events.trim_requested:
                    self._trim_reserve(0)
            self._refresh_room()
            target = 0 if self._over_limit() else self._policy.end_interval()
            if len(self._reserve) > target:
                self._trim_reserve(target)
            elif self._cfg.premap and len(self._reserve) + self._inflight_pages < target:
                if self._async:
                    self._refill_async()
                else:
                    self._refill_sync(target - len(self._reserve))
            self._publish()

    def _refill_async(self) -> None:
        """Queue background maps to bring reserve + in-flight pages up to the policy's target, within the
        physical headroom (charged now, so that two pools cannot both count on the same bytes)."""
        want = self._policy.target - len(self._reserve) - self._inflight_pages
        pages: list[int] = []
        while want > 0 and self._unmapped and not self._over_limit():
            page = self._unmapped[-1]
            if not self._charge(self._geo.exclusive_bytes([page], self._is_backed)):
                break
            self._pop_unmapped()
            self._page_state[page] = _INFLIGHT
            self._inflight_pages += 1
            pages.append(page)
            want -= 1
        if pages:
            assert isinstance(self._mapper, AsyncPageMapper)
            try:
                job = self._mapper.map_async(pages)
            except BaseException:
                self._undo_inflight(pages)
                raise
            self._inflight[job] = pages

    def _refill_sync(self, want: int) -> None:
        """Map up to ``want`` reserve pages on this thread (mappers without a background thread)."""
        pages = [self._pop_unmapped() for _ in range(min(want, len(self._unmapped)))]
        if not pages:
            return
        try:
            self._map_now(pages)
        except PoolExhausted:
            self._push_unmapped(pages)
            return
        for p in pages:
            self._page_to_reserve(p)

    def _collect(self) -> None:
        """Take in the background maps that finished: mapped pages join the reserve, failed ones return
        to the unmapped pages with their charge."""
        assert isinstance(self._mapper, AsyncPageMapper)
        for job, pages, error in self._mapper.collect():
            mine = self._inflight.pop(job, None)
            if mine is None or sorted(mine) != sorted(pages):
                self._fail(f"data plane reported map job {job} ({pages}) that the ledger did not queue")
            assert mine is not None
            if error is None:
                for p in mine:
                    self._inflight_pages -= 1
                    self._page_to_reserve(p)
            else:
                logger.debug("background map of pages %s failed: %s", mine, error)
                self._room_read_at = float("-inf")
                self._undo_inflight(mine)

    def _undo_inflight(self, pages: list[int]) -> None:
        """In-flight pages that will not be mapped: back to unmapped, their charge returned."""
        nbytes = self._geo.exclusive_bytes(pages, self._is_backed)
        for p in pages:
            self._page_state[p] = _UNMAPPED
            self._inflight_pages -= 1
        self._push_unmapped(pages)
        self._uncharge(nbytes)

    def _await_inflight(self) -> None:
        deadline = self._clock() + _INFLIGHT_WAIT_S
        while self._inflight and self._clock() < deadline:
            time.sleep(0.0001)
            self._collect()

    # -- limits -----------------------------------------------------------------------------------------

    def resize(self, limit_bytes: int) -> None:
        """Follow a new physical limit (0 = none). Raising it lets the pool grow at once. Lowering it stops
        new pages beyond the limit, unmaps reserve pages now, unmaps pages as they empty, and completes as
        live blocks drain; a page with live blocks is never unmapped. ``ValueError`` if negative."""
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes={limit_bytes} must be >= 0 (0 = no limit)")
        with self._lock:
            self._check_usable()
            self._apply_limit(limit_bytes)

    def _apply_limit(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        if self._over_limit():
            self._trim_reserve(0)
            logger.info(
                "pool %s shrinking: %d bytes backed, limit %d", self._name, self._charged, self._limit
            )

    def trim(self) -> int:
        """Unmap every reserve page now; returns how many were unmapped. Pages pending release stay until
        their epoch is released."""
        with self._lock:
            self._check_usable()
            return self._trim_reserve(0)

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
        with self._lock:
            self._check_usable()
            live = [b for b in range(self._nb) if self._live[b] and b != self._null]
            if live:
                self._free(live)
            self._trim_reserve(0)

    def close(self) -> None:
        """Unmap every page (the null block's too) and return the charge. The pool is unusable after;
        idempotent. Only call it when no GPU work can touch the pool any more."""
        with self._lock:
            if self._closed:
                return
            if self._broken is None:
                if self._inflight:
                    self._await_inflight()
                backed = self.mapped_pages()
                if backed:
                    self._unmap_now(backed)
            self._closed = True

    # -- snapshot ---------------------------------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        """The pool's statistics now."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> PoolSnapshot:
        if self._closed:
            state = PoolState.CLOSED
        elif self._broken is not None:
            state = PoolState.INCONSISTENT
        elif self._over_limit():
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
            used_blocks=self._used - has_null,
            free_blocks=self._nb - self._used,
            available_blocks=self.available_size(),
            total_pages=self._npages,
            mapped_pages=self._npages - len(self._unmapped) - self._inflight_pages,
            reserve_pages=len(self._reserve),
            pending_pages=len(self._pending_epoch),
            inflight_pages=self._inflight_pages,
            mapped_bytes=self._charged,
            limit_bytes=self._limit,
            reserve_hits=self._hits,
            reserve_misses=self._misses,
            epoch=self._epoch,
            timestamp=time.time(),
        )

    def _publish(self) -> None:
        if self._record is None:
            return
        now = self._clock()
        if now - self._published_at >= self._cfg.publish_interval_s:
            self._published_at = now
            self._record.publish(self._snapshot())

    # -- page transitions -------------------------------------------------------------------------------

    def _cap(self, page: int) -> int:
        return self._last_cap if page == self._npages - 1 else self._bpp

    def _is_backed(self, page: int) -> bool:
        return self._page_state[page] != _UNMAPPED

    def _pop_unmapped(self) -> int:
        page = self._unmapped.pop()
        self._unmapped_blocks -= self._cap(page)
        return page

    def _push_unmapped(self, pages: list[int]) -> None:
        """Pages back to the unmapped stack, lowest id on top (so it is mapped again first)."""
        self._unmapped.extend(sorted(pages, reverse=True))
        self._unmapped_blocks += sum(self._cap(p) for p in pages)

    def _page_to_reserve(self, page: int) -> None:
        """A page just backed: every block of it is free."""
        blocks = self._geo.blocks_of(page)
        self._page_free[page] = list(reversed(blocks))
        self._free_backed += len(blocks)
        self._page_state[page] = _RESERVE
        self._reserve.append(page)

    def _rebucket(self, page: int) -> None:
        """File a partly used page under its free count."""
        k = len(self._page_free[page])
        self._page_bucket[page] = k
        self._buckets[k][page] = None
        self._mask |= 1 << k

    def _unbucket(self, page: int) -> None:
        k = self._page_bucket[page]
        if k:
            bucket = self._buckets[k]
            del bucket[page]
            if not bucket:
                self._mask &= ~(1 << k)
            self._page_bucket[page] = 0

    # -- physical side ----------------------------------------------------------------------------------

    def _over_limit(self) -> bool:
        return bool(self._limit) and self._charged > self._limit

    def _room_bytes(self) -> int:
        """Bytes the pool may still charge: its own limit, and the outside headroom read in maintain()
        less what the pool charged since."""
        outside = self._outside_room - (self._charged - self._charged_at_read)
        if self._limit:
            outside = min(outside, self._limit - self._charged)
        return max(0, outside)

    def _refresh_room(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._room_read_at < self._cfg.free_memory_ttl_s:
            return
        room = 1 << 62
        if self._record is not None:
            room = min(room, self._record.headroom_bytes)
        if self._physical_free is not None:
            room = min(room, max(0, self._physical_free() - self._cfg.min_free_bytes))
        self._outside_room = room
        self._charged_at_read = self._charged
        self._room_read_at = now

    def _charge(self, nbytes: int) -> bool:
        if nbytes > self._room_bytes():
            return False
        if self._record is not None and not self._record.try_charge(nbytes):
            self._room_read_at = float("-inf")
            return False
        self._charged += nbytes
        return True

    def _uncharge(self, nbytes: int) -> None:
        if nbytes:
            self._charged -= nbytes
            if self._record is not None:
                self._record.uncharge(nbytes)

    def _map_now(self, pages: list[int]) -> None:
        """Charge and back ``pages`` synchronously; PoolExhausted (nothing changed) if either fails."""
        nbytes = self._geo.exclusive_bytes(pages, self._is_backed)
        if not self._charge(nbytes):
            raise PoolExhausted(f"pool {self._name}: no room for {nbytes} more bytes (limit or budget)")
        start = time.perf_counter()
        try:
            self._mapper.map(pages)
        except PoolExhausted:
            self._uncharge(nbytes)
            raise
        except StateConsistencyError as exc:
            self._uncharge(nbytes)
            self._fail(f"map of pages {pages} failed to roll back: {exc}")
        except ValueError as exc:
            self._uncharge(nbytes)
            self._fail(f"data plane refused to map pages {pages} the ledger holds unmapped: {exc}")
        if self._record is not None:
            self._record.observe("map", time.perf_counter() - start)

    def _unmap_now(self, pages: list[int]) -> None:
        """Unmap backed pages (empty ones; at close, any) and return their charge."""
        nbytes = self._geo.exclusive_bytes(pages, self._is_backed)
        start = time.perf_counter()
        try:
            self._mapper.unmap(pages)
        except (StateConsistencyError, ValueError) as exc:
            self._fail(f"unmap of pages {pages} failed: {exc}")
        if self._record is not None:
            self._record.observe("unmap", time.perf_counter() - start)
        for p in pages:
            self._unbucket(p)
            self._free_backed -= len(self._page_free[p])
            self._page_free[p] = []
            self._page_state[p] = _UNMAPPED
        self._push_unmapped(pages)
        self._uncharge(nbytes)

    def _fail(self, message: str) -> None:
        self._broken = message
        logger.error("pool %s is inconsistent: %s", self._name, message)
        raise StateConsistencyError(f"pool {self._name}: {message}")

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError(f"pool {self._name} is closed")
        if self._broken is not None:
            raise StateConsistencyError(f"pool {self._name} is inconsistent: {self._broken}")
