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
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from threading import get_ident
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
        # The owner thread's ident while the pool is usable, -1 once it is closed or inconsistent: one
        # comparison on the hot paths checks both.
        self._thread = get_ident()
        self._owner = self._thread
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
            self._live[null_block] = 2  # live, and never accepted by free()
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
            out = free[-n:]
            del free[-n:]
            rest = k - n
            self._page_bucket[page] = rest
            if rest:
                self._buckets[rest][page] = None
                mask |= 1 << rest
            self._mask = mask
            live = self._live
            for b in out:
                live[b] = 1
            self._free_backed -= n
            self._used += n
            return out
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
            self._unpop_unmapped(pages)
            return -1
        except BaseException:
            self._unpop_unmapped(pages)  # a driver error after the data plane's rollback: nothing changed
            raise
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
        self._release_blocks(blocks)

    def _release_blocks(self, blocks: list[int]) -> None:
        """Mark valid, distinct live ``blocks`` free and re-file their pages."""
        live, bpp, page_free = self._live, self._bpp, self._page_free
        for b in blocks:
            live[b] = 0
            page_free[b // bpp].append(b)
        n = len(blocks)
        self._free_backed += n
        self._used -= n
        pages = (blocks[0] // bpp,) if n == 1 else {b // bpp for b in blocks}
        buckets, page_bucket, mask = self._buckets, self._page_bucket, self._mask
        last, emptied = self._npages - 1, []
        for p in pages:
            k = page_bucket[p]
            if k:
                bucket = buckets[k]
                del bucket[p]
                if not bucket:
                    mask ^= 1 << k
            free = len(page_free[p])
            if free == (bpp if p != last else self._last_cap):
                page_bucket[p] = 0
                emptied.append(p)
            else:
                page_bucket[p] = free
                buckets[free][p] = None
                mask |= 1 << free
        self._mask = mask
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
        if get_ident() != self._owner:
            self._refuse()
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
            self._unpop_unmapped(pages)
            return
        except BaseException:
            self._unpop_unmapped(pages)
            raise
        for p in pages:
            self._page_to_reserve(p)

    def _collect(self, wait: bool = False) -> None:
        """Take in the background maps that finished (all of them, with ``wait``): mapped pages join the
        reserve, failed ones return to the unmapped pages with their charge."""
        assert isinstance(self._mapper, AsyncPageMapper)
        for job, pages, error in self._mapper.collect(wait):
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
                self._room_read_at = float("-inf")
                self._undo_inflight(mine)
        if self._over_limit():
            self._trim_reserve(0)  # the limit was lowered while these were in flight

    def _undo_inflight(self, pages: list[int]) -> None:
        """In-flight pages that will not be mapped: back to unmapped, their charge returned."""
        nbytes = self._geo.exclusive_bytes(pages, self._is_backed)
        for p in pages:
            self._page_state[p] = _UNMAPPED
            self._inflight_pages -= 1
        self._push_unmapped(pages)
        self._uncharge(nbytes)

    def _await_inflight(self) -> None:
        """Wait for every queued background map (they are needed now: a sync map would queue behind
        them in the driver anyway)."""
        self._collect(wait=True)

    def settle(self) -> None:
        """Wait for every background map queued so far and take it in (its pages join the reserve).

        Engines call it before sleeping or tearing a pool down; tests call it to make a pool's state
        independent of the background thread's timing."""
        if get_ident() != self._owner:
            self._refuse()
        if self._inflight:
            self._collect(wait=True)

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
        self._limit = limit_bytes
        if self._over_limit():
            self._trim_reserve(0)
            logger.info(
                "pool %s shrinking: %d bytes backed, limit %d", self._name, self._charged, self._limit
            )

    def trim(self) -> int:
        """Unmap every reserve page now; returns how many were unmapped. Pages pending release stay until
        their epoch is released."""
        if get_ident() != self._owner:
            self._refuse()
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
        if get_ident() != self._owner:
            self._refuse()
        live = [b for b in range(self._nb) if self._live[b] and b != self._null]
        if live:
            self._release_blocks(live)
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
                self._await_inflight()
            backed = self.mapped_pages()
            if backed:
                self._unmap_now(backed, closing=True)
        self._closed = True
        self._owner = -1

    # -- snapshot ---------------------------------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        """The pool's statistics now."""
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

    def _unpop_unmapped(self, pages: list[int]) -> None:
        """Undo ``_pop_unmapped`` calls that returned ``pages`` (in that order): the stack is as before."""
        self._unmapped.extend(reversed(pages))
        self._unmapped_blocks += sum(self._cap(p) for p in pages)

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
        """Charge and back ``pages`` synchronously. Raises (with the charge returned and the data plane
        unchanged) ``PoolExhausted`` when the limit, the budget or the driver refuses, or the data plane's
        error for another driver failure; marks the pool inconsistent if the data plane is."""
        nbytes = self._geo.exclusive_bytes(pages, self._is_backed)
        if not self._charge(nbytes):
            raise PoolExhausted(f"pool {self._name}: no room for {nbytes} more bytes (limit or budget)")
        start = time.perf_counter()
        try:
            self._mapper.map(pages)
        except PoolExhausted:
            self._uncharge(nbytes)
            self._room_read_at = float("-inf")  # re-read the driver's free memory at the next maintain()
            raise
        except StateConsistencyError as exc:
            self._fail(f"map of pages {pages} failed to roll back: {exc}")
        except ValueError as exc:
            self._fail(f"data plane refused to map pages {pages} the ledger holds unmapped: {exc}")
        except BaseException:
            self._uncharge(nbytes)
            raise
        if self._record is not None:
            self._record.observe("map", time.perf_counter() - start)

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
                self._page_state[p] = _RESERVE
            self._reserve.extend(pages)
            return
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
