"""The ledger's bookkeeping: which blocks are free on which pages, and each page's state.

:class:`PageBook` holds the data structures of :class:`elastic_kv.ledger.KVCacheManager` and the
operations that keep them consistent; it makes no policy decision (when to map, unmap, defer or refill:
that is the manager's) and never calls the data plane. Its invariants, checked by the tests after every
step of a random walk:

* a block is live (``_live[b]`` 1, or 2 for the null block) or on exactly one free list, or its page is
  unmapped or in flight (then all its blocks are free and on no list);
* ``_page_free[p]`` holds the free blocks of backed page ``p``; ``_free_backed`` is their total;
* a page in use with ``k`` free blocks (0 < k) is in ``_buckets[k]`` and bit ``k`` of ``_mask`` is set,
  and a page is in no bucket otherwise; ``_page_bucket[p]`` says which;
* every page is in exactly one of: in use (``USED``), ``_reserve`` (backed, empty),
  ``_pending_epoch`` (backed, empty, waiting for its epoch), ``_withheld_epoch`` (``WITHHELD``: backed,
  empty, draining, waiting for its epoch to be unmapped), ``_unmapped`` (a stack), in flight;
* a **draining** page (``_draining[p]``, a ``USED`` or ``WITHHELD`` page the ledger is releasing to get
  under a lowered limit) issues no block: it is in no bucket, and its free blocks are counted in
  ``_withheld_free`` instead of ``_free_backed``, so no allocation path can see them.

Data structures (chosen for the per-block cost on the engine's scheduling thread):

* ``_live``: a ``bytearray`` over block ids -- O(1) double-free / foreign-id checks;
* ``_page_free[p]``: the free block ids of a backed page, a list used as a stack (taking ``n`` blocks is
  one slice off its end, freeing one is an append), so blocks freed last are reused first;
* ``_buckets[k]``: the partly used pages with exactly ``k`` free blocks (a dict as an insertion-ordered
  set with O(1) removal), plus ``_mask``, a bit set of the non-empty buckets: "the smallest page that
  holds ``n``" is one shift and one lowest-set-bit, O(1) whatever the number of pages;
* ``_reserve`` / ``_unmapped``: stacks of page ids; ``_pending`` a queue of (epoch, page) whose stale
  entries (the page was reused, or emptied again later) are recognised through ``_pending_epoch``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from elastic_kv.geometry import BlockGeometry

__all__ = ["PageBook"]

# Page states (one byte per page in _page_state), shared with elastic_kv.ledger.
UNMAPPED, USED, RESERVE, PENDING, INFLIGHT, WITHHELD = 0, 1, 2, 3, 4, 5
_STATE_NAMES = ("unmapped", "used", "reserve", "pending", "inflight", "withheld")


class PageBook:
    """Free blocks per page and page states of one pool (see the module docstring)."""

    def __init__(self, geometry: BlockGeometry) -> None:
        self._geo = geometry
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
        self._draining = bytearray(npages)  # 1: the page is being released; none of its blocks is issued
        self._drain_count = 0  # pages flagged in _draining
        self._withheld_epoch: dict[int, int] = {}  # WITHHELD page -> epoch it emptied in

        self._free_backed = 0  # free blocks on USED/RESERVE/PENDING pages that are not draining
        self._withheld_free = 0  # free blocks on draining pages: never issued
        self._unmapped_blocks = nb
        self._inflight_pages = 0

    def page_state(self, page: int) -> str:
        """``"unmapped" | "used" | "reserve" | "pending" | "inflight" | "withheld"`` (for tests and
        diagnostics)."""
        return _STATE_NAMES[self._page_state[page]]

    def is_live(self, block: int) -> bool:
        """Whether ``block`` is issued (the null block is always live)."""
        return bool(self._live[block])

    def live_blocks_on(self, page: int) -> int:
        """Issued blocks of ``page`` (the null block counts); O(1), from the page's free list."""
        if self._page_state[page] in (UNMAPPED, INFLIGHT):
            return 0
        return self._cap(page) - len(self._page_free[page])

    def mapped_pages(self) -> list[int]:
        """Pages the ledger holds backed (used, reserve, pending, withheld), ascending."""
        st = self._page_state
        return [p for p in range(self._npages) if st[p] in (USED, RESERVE, PENDING, WITHHELD)]

    @property
    def draining(self) -> bool:
        """Whether any page is draining (O(1): engines check it every step)."""
        return self._drain_count > 0

    def is_draining(self, page: int) -> bool:
        """Whether ``page`` is being released to meet a lowered limit (no block on it is issued)."""
        return bool(self._draining[page])

    def draining_pages(self) -> list[int]:
        """Draining pages that still hold live blocks, ascending: the engine must free those blocks
        (preempt the requests holding them, evict cached ones) for the pages to be released."""
        if not self._drain_count:
            return []
        st, drain = self._page_state, self._draining
        return [p for p in range(self._npages) if drain[p] and st[p] == USED]

    def holds_draining(self, blocks: Iterable[int]) -> bool:
        """Whether any of ``blocks`` (issued ids) lies on a draining page."""
        if not self._drain_count:
            return False
        drain, bpp = self._draining, self._bpp
        return any(drain[b // bpp] for b in blocks)

    def _take_blocks(self, n: int) -> tuple[list[int], int]:
        """Take ``n <= _free_backed`` free blocks, now live: partly used pages by best fit (the smallest
        page that holds the rest of the run, else the one with the most free blocks), then empty backed
        pages -- pending release first (reusing one saves an unmap and a map), then the reserve. Returns the
        ids and how many empty pages were taken into use."""
        out: list[int] = []
        buckets, page_free = self._buckets, self._page_free
        left = n
        while left and self._mask:
            mask = self._mask
            k = self._pick_bucket(mask, left)
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
            self._page_state[page] = USED
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
        return out, acquired

    @staticmethod
    def _pick_bucket(mask: int, left: int) -> int:
        """The free count of the partly used page to take from next: the smallest that holds all ``left``
        blocks (best fit), else the largest (the emptiest page: fewest pages touched). ``mask`` != 0."""
        fit = mask >> left
        return left + ((fit & -fit).bit_length() - 1) if fit else mask.bit_length() - 1

    def _return_blocks(self, blocks: list[int]) -> list[int]:
        """Mark valid, distinct live ``blocks`` free and re-file their pages; returns the pages that became
        empty (still backed: the caller decides their fate)."""
        live, bpp, page_free = self._live, self._bpp, self._page_free
        for b in blocks:
            live[b] = 0
            page_free[b // bpp].append(b)
        n = len(blocks)
        self._free_backed += n
        pages: Iterable[int] = (blocks[0] // bpp,) if n == 1 else {b // bpp for b in blocks}
        drained: list[int] | None = None
        if self._drain_count:
            pages, drained = self._return_to_draining(blocks, pages)
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
        return emptied + drained if drained else emptied

    def _return_to_draining(self, blocks: list[int], pages: Iterable[int]) -> tuple[list[int], list[int]]:
        """``_return_blocks`` while pages drain: blocks freed on draining pages are withheld, not counted
        free, and their pages stay out of the buckets. Returns the other pages (for the usual filing) and
        the draining pages that emptied."""
        drain, bpp = self._draining, self._bpp
        held = sum(1 for b in blocks if drain[b // bpp])
        self._free_backed -= held
        self._withheld_free += held
        rest: list[int] = []
        drained: list[int] = []
        for p in pages:
            if not drain[p]:
                rest.append(p)
            elif len(self._page_free[p]) == self._cap(p):
                drained.append(p)
        return rest, drained

    def _withhold(self, page: int) -> None:
        """Start draining a ``USED`` page: its free blocks are withheld and it leaves the buckets."""
        self._unbucket(page)
        n = len(self._page_free[page])
        self._free_backed -= n
        self._withheld_free += n
        self._draining[page] = 1
        self._drain_count += 1

    def _unwithhold(self, page: int) -> None:
        """Stop draining ``page`` (the pool got under its limit another way, or the limit was lifted): its
        free blocks can be issued again; a ``WITHHELD`` page becomes an ordinary pending one (same epoch,
        so its queue entry stays valid)."""
        if not self._draining[page]:
            return
        self._draining[page] = 0
        self._drain_count -= 1
        n = len(self._page_free[page])
        self._withheld_free -= n
        self._free_backed += n
        epoch = self._withheld_epoch.pop(page, None)
        if epoch is not None:
            self._page_state[page] = PENDING
            self._pending_epoch[page] = epoch
        elif self._page_state[page] == USED and n:
            self._rebucket(page)

    def _cancel_drain(self, page: int) -> None:
        """``page`` leaves the drain because it is being unmapped (or kept backed after an unmap failed):
        its blocks count as free again, its state is the caller's to set."""
        if self._draining[page]:
            self._withheld_epoch.pop(page, None)
            self._unwithhold(page)

    def _cap(self, page: int) -> int:
        return self._last_cap if page == self._npages - 1 else self._bpp

    def _is_backed(self, page: int) -> bool:
        return self._page_state[page] != UNMAPPED

    def _live_count(self) -> int:
        """Live blocks, the null block included: every block not free on a backed, in-flight or unmapped
        page (derived, so that alloc and free update one counter, not two)."""
        inflight = sum(len(self._geo.blocks_of(p)) for pages in self._inflight.values() for p in pages)
        return self._nb - self._free_backed - self._withheld_free - self._unmapped_blocks - inflight

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
        self._page_state[page] = RESERVE
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

    def _unback(self, pages: list[int]) -> None:
        """Pages the data plane just released: their blocks leave the free count, the pages the buckets."""
        for p in pages:
            self._cancel_drain(p)
            self._unbucket(p)
            self._free_backed -= len(self._page_free[p])
            self._page_free[p] = []
            self._page_state[p] = UNMAPPED
        self._push_unmapped(pages)

    def check_invariants(self) -> None:
        """Verify every invariant of the module docstring; ``AssertionError`` names the first one broken.

        O(blocks + pages): for tests, soaks and debugging, never on an engine's path."""
        state, free_lists, live = self._page_state, self._page_free, self._live
        inflight = {p for pages in self._inflight.values() for p in pages}
        assert len(inflight) == self._inflight_pages, "in-flight page count"
        on_lists: set[int] = set()
        withheld = 0
        unmapped_blocks = 0
        drain = self._draining
        for p in range(self._npages):
            blocks = self._geo.blocks_of(p)
            st = state[p]
            assert self._cap(p) == len(blocks), f"page {p}: capacity"
            assert self.live_blocks_on(p) == sum(1 for b in blocks if live[b]), f"page {p}: live count"
            assert not drain[p] or st in (USED, WITHHELD), f"{_STATE_NAMES[st]} page {p} is draining"
            assert (st == WITHHELD) == (p in self._withheld_epoch), f"page {p}: withheld state"
            if st in (UNMAPPED, INFLIGHT):
                assert not free_lists[p], f"page {p} ({_STATE_NAMES[st]}) has a free list"
                assert not any(live[b] for b in blocks), f"live block on {_STATE_NAMES[st]} page {p}"
                assert (p in inflight) == (st == INFLIGHT), f"page {p} in-flight state"
                unmapped_blocks += len(blocks) if st == UNMAPPED else 0
                continue
            free = free_lists[p]
            assert len(set(free)) == len(free) and all(b in blocks and not live[b] for b in free), (
                f"page {p}: free list holds a live, foreign or repeated block"
            )
            assert len(free) + sum(1 for b in blocks if live[b]) == len(blocks), f"page {p}: blocks lost"
            if drain[p]:
                withheld += len(free)
            else:
                on_lists.update(free)
            empty = len(free) == len(blocks)
            if st == USED and drain[p]:
                assert not empty, f"draining page {p} in use without live blocks"
                assert self._page_bucket[p] == 0, f"draining page {p} is in a bucket"
            elif st == USED:
                assert not empty, f"page {p} in use without live blocks"
                k = len(free)
                assert self._page_bucket[p] == k and (k == 0 or p in self._buckets[k]), f"page {p}: bucket"
            else:
                assert empty, f"{_STATE_NAMES[st]} page {p} has live blocks"
                assert self._page_bucket[p] == 0, f"{_STATE_NAMES[st]} page {p} is in a bucket"
        assert len(on_lists) == self._free_backed, "free block count"
        assert withheld == self._withheld_free, "withheld block count"
        assert sum(drain) == self._drain_count, "draining page count"
        for k, bucket in enumerate(self._buckets):
            assert bool(bucket) == bool(self._mask >> k & 1), f"mask bit {k}"
            assert all(state[p] == USED and len(free_lists[p]) == k and not drain[p] for p in bucket), (
                f"bucket {k}"
            )
