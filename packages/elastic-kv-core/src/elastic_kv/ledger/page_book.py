"""The ledger's bookkeeping: which blocks are free on which pages, and each page's state.

One file over 400 lines on purpose: one data structure, its operations kept beside the fields
they keep consistent and the invariants below.

:class:`PageBook` holds the data structures of one pool's :class:`~elastic_kv.ledger.Ledger` and the
operations that keep them consistent; it makes no policy decision (when to map, unmap, defer or refill:
that is the ledger's) and never calls the data plane. Its fields are public to the ledger package: the
ledger and its :class:`~elastic_kv.ledger.page_backing.PageBacking` read them on hot paths and change them
through the methods below (plus the page-state moves that are pure policy: reserve, pending). Its
invariants, checked by the tests after every step of a random walk:

* a block is live (``live[b]`` 1, or 2 for the null block) or on exactly one free list, or its page is
  unmapped or in flight (then all its blocks are free and on no list);
* ``page_free[p]`` holds the free blocks of backed page ``p``; ``free_backed`` is their total;
* a page in use with ``k`` free blocks (0 < k) is in ``buckets[k]`` and bit ``k`` of ``mask`` is set,
  and a page is in no bucket otherwise; ``page_bucket[p]`` says which;
* every page is in exactly one of: in use (``USED``), ``reserve`` (backed, empty),
  ``pending_epoch`` (backed, empty, waiting for its epoch), ``withheld_epoch`` (``WITHHELD``: backed,
  empty, draining, waiting for its epoch to be unmapped), ``unmapped`` (a stack), in flight;
* a **draining** page (``drain[p]``, a ``USED`` or ``WITHHELD`` page the ledger is releasing to get under
  a lowered limit, :mod:`elastic_kv.ledger.drain`) issues no block: it is in no bucket, and its free
  blocks are counted in ``withheld_free`` instead of ``free_backed``, so no allocation path sees them.

Data structures (chosen for the per-block cost on the engine's scheduling thread):

* ``live``: a ``bytearray`` over block ids -- O(1) double-free / foreign-id checks;
* ``page_free[p]``: the free block ids of a backed page, a list used as a stack (taking ``n`` blocks is
  one slice off its end, freeing one is an append), so blocks freed last are reused first;
* ``buckets[k]``: the partly used pages with exactly ``k`` free blocks (a dict as an insertion-ordered
  set with O(1) removal), plus ``mask``, a bit set of the non-empty buckets: "the smallest page that
  holds ``n``" is one shift and one lowest-set-bit, O(1) whatever the number of pages;
* ``reserve`` / ``unmapped``: stacks of page ids; ``pending`` a queue of (epoch, page) whose stale
  entries (the page was reused, or emptied again later) are recognised through ``pending_epoch``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from elastic_kv.geometry import BlockGeometry

__all__ = ["INFLIGHT", "PENDING", "RESERVE", "UNMAPPED", "USED", "WITHHELD", "PageBook"]

# Page states (one byte per page in PageBook.state).
UNMAPPED, USED, RESERVE, PENDING, INFLIGHT, WITHHELD = 0, 1, 2, 3, 4, 5
_STATE_NAMES = ("unmapped", "used", "reserve", "pending", "inflight", "withheld")


class PageBook:
    """Free blocks per page and page states of one pool (see the module docstring)."""

    def __init__(self, geometry: BlockGeometry) -> None:
        self.geo = geometry
        nb, bpp, npages = geometry.num_blocks, geometry.blocks_per_page, geometry.num_pages
        self.nb, self.bpp, self.npages = nb, bpp, npages
        self._last_cap = nb - (npages - 1) * bpp  # blocks on the last page
        self.live = bytearray(nb)
        self.state = bytearray(npages)
        self.page_free: list[list[int]] = [[] for _ in range(npages)]
        self.page_bucket = [0] * npages  # the bucket a USED page is in (0 = none: full, or not USED)
        self.buckets: list[dict[int, None]] = [{} for _ in range(bpp + 1)]
        self.mask = 0  # bit k set <=> buckets[k] is not empty
        self.reserve: list[int] = []
        self.pending: deque[tuple[int, int]] = deque()  # (epoch, page); stale entries are skipped
        self.pending_epoch: dict[int, int] = {}  # PENDING page -> epoch it emptied in
        self.unmapped = list(range(npages - 1, -1, -1))  # a stack: lowest page ids are mapped first
        self.inflight: dict[int, list[int]] = {}  # map_async job id -> its pages
        self.drain = bytearray(npages)  # 1: the page is being released; none of its blocks is issued
        self.drain_count = 0  # pages flagged in drain
        self.withheld_epoch: dict[int, int] = {}  # WITHHELD page -> epoch it emptied in

        self.free_backed = 0  # free blocks on USED/RESERVE/PENDING pages that are not draining
        self.withheld_free = 0  # free blocks on draining pages: never issued
        self.unmapped_blocks = nb
        self.inflight_pages = 0

    def page_state(self, page: int) -> str:
        """``"unmapped" | "used" | "reserve" | "pending" | "inflight" | "withheld"`` (for tests and
        diagnostics)."""
        return _STATE_NAMES[self.state[page]]

    def is_live(self, block: int) -> bool:
        """Whether ``block`` is issued (the null block is always live)."""
        return bool(self.live[block])

    def live_blocks_on(self, page: int) -> int:
        """Issued blocks of ``page`` (the null block counts); O(1), from the page's free list."""
        if self.state[page] in (UNMAPPED, INFLIGHT):
            return 0
        return self.cap(page) - len(self.page_free[page])

    def mapped_pages(self) -> list[int]:
        """Pages the ledger holds backed (used, reserve, pending, withheld), ascending."""
        st = self.state
        return [p for p in range(self.npages) if st[p] in (USED, RESERVE, PENDING, WITHHELD)]

    def take_fit(self, n: int) -> list[int] | None:
        """``n >= 1`` blocks from the one partly used page that holds them all -- the smallest such page
        (best fit: one shift and one lowest-set-bit of the bucket mask) -- now live; ``None`` with nothing
        taken when no partly used page holds ``n``. The allocation fast path: a decode step, most
        prefills."""
        mask = self.mask
        fit = mask >> n
        if not fit:
            return None
        k = n + ((fit & -fit).bit_length() - 1)
        bucket = self.buckets[k]
        page, _ = bucket.popitem()
        if not bucket:
            mask ^= 1 << k
        free = self.page_free[page]
        rest = k - n
        self.page_bucket[page] = rest
        if rest:
            self.buckets[rest][page] = None
            mask |= 1 << rest
        self.mask = mask
        self.free_backed -= n
        live = self.live
        if n == 1:  # a decode step's block: one pop, no slices
            block = free.pop()
            live[block] = 1
            return [block]
        out = free[-n:]
        del free[-n:]
        for block in out:
            live[block] = 1
        return out

    def take_blocks(self, n: int) -> tuple[list[int], int]:
        """Take ``n <= free_backed`` free blocks, now live: partly used pages by best fit (the smallest
        page that holds the rest of the run, else the one with the most free blocks), then empty backed
        pages -- pending release first (reusing one saves an unmap and a map), then the reserve. Returns the
        ids and how many empty pages were taken into use."""
        out: list[int] = []
        buckets, page_free = self.buckets, self.page_free
        left = n
        while left and self.mask:
            mask = self.mask
            k = self._pick_bucket(mask, left)
            bucket = buckets[k]
            page, _ = bucket.popitem()
            if not bucket:
                self.mask = mask & ~(1 << k)
            take = k if k <= left else left
            free = page_free[page]
            out += free[-take:]
            del free[-take:]
            left -= take
            self.page_bucket[page] = 0
            if take < k:
                self.rebucket(page)
        acquired = 0
        while left:
            if self.pending_epoch:
                page, _ = self.pending_epoch.popitem()  # its queue entry goes stale
            else:
                page = self.reserve.pop()
            self.state[page] = USED
            acquired += 1
            free = page_free[page]
            take = min(left, len(free))
            out += free[-take:]
            del free[-take:]
            left -= take
            if free:
                self.rebucket(page)
        live = self.live
        for b in out:
            live[b] = 1
        self.free_backed -= n
        return out, acquired

    @staticmethod
    def _pick_bucket(mask: int, left: int) -> int:
        """The free count of the partly used page to take from next: the smallest that holds all ``left``
        blocks (best fit), else the largest (the emptiest page: fewest pages touched). ``mask`` != 0."""
        fit = mask >> left
        return left + ((fit & -fit).bit_length() - 1) if fit else mask.bit_length() - 1

    def check_free(self, blocks: list[int]) -> None:
        """``ValueError`` naming the first bad id unless ``blocks`` are distinct, issued (live, not the null
        block) Python ints of this pool; nothing changes either way."""
        live, nb = self.live, self.nb
        for b in blocks:
            # live[b] is 1 for an issued block, 0 for a free one, 2 for the null block
            if type(b) is not int or not 0 <= b < nb or live[b] != 1:
                raise ValueError(self._bad_id_message(blocks))
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):
            raise ValueError(self._bad_id_message(blocks))

    def _bad_id_message(self, blocks: Sequence[int]) -> str:
        seen: set[int] = set()
        for b in blocks:
            if type(b) is not int:
                return f"block id {b!r} is not an int"
            if not 0 <= b < self.nb:
                return f"block id {b} outside this pool's 0..{self.nb - 1}"
            if self.live[b] == 2:
                return f"block {b} is the null block; it is never freed"
            if b in seen:
                return f"block {b} appears twice in one free()"
            if not self.live[b]:
                return f"block {b} is not live (double free, or an id this pool never issued)"
            seen.add(b)
        raise AssertionError("no bad id")  # pragma: no cover

    def return_blocks(self, blocks: list[int]) -> list[int]:
        """Mark valid, distinct live ``blocks`` free and re-file their pages; returns the pages that became
        empty (still backed: the caller decides their fate), draining ones included. Blocks freed on a
        draining page are withheld: not counted free, their page stays out of the buckets."""
        live, bpp, page_free = self.live, self.bpp, self.page_free
        for b in blocks:
            live[b] = 0
            page_free[b // bpp].append(b)
        n = len(blocks)
        self.free_backed += n
        pages: Iterable[int] = (blocks[0] // bpp,) if n == 1 else {b // bpp for b in blocks}
        drained: list[int] = []
        if self.drain_count:
            pages, drained = self._return_to_draining(blocks, pages)
        buckets, page_bucket, mask = self.buckets, self.page_bucket, self.mask
        last, emptied = self.npages - 1, []
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
        self.mask = mask
        return emptied + drained if drained else emptied

    def _return_to_draining(self, blocks: list[int], pages: Iterable[int]) -> tuple[list[int], list[int]]:
        """Withhold the blocks of ``blocks`` on draining pages; returns the other pages (for the usual
        filing) and the draining pages that emptied."""
        drain, bpp = self.drain, self.bpp
        held = sum(1 for b in blocks if drain[b // bpp])
        self.free_backed -= held
        self.withheld_free += held
        rest: list[int] = []
        drained: list[int] = []
        for p in pages:
            if not drain[p]:
                rest.append(p)
            elif len(self.page_free[p]) == self.cap(p):
                drained.append(p)
        return rest, drained

    def withhold(self, page: int) -> None:
        """Start draining a ``USED`` page: its free blocks are withheld and it leaves the buckets."""
        self.unbucket(page)
        n = len(self.page_free[page])
        self.free_backed -= n
        self.withheld_free += n
        self.drain[page] = 1
        self.drain_count += 1

    def unwithhold(self, page: int) -> None:
        """Stop draining ``page``: its free blocks can be issued again; a ``WITHHELD`` page becomes an
        ordinary pending one (same epoch, so its queue entry stays valid)."""
        if not self.drain[page]:
            return
        self.drain[page] = 0
        self.drain_count -= 1
        n = len(self.page_free[page])
        self.withheld_free -= n
        self.free_backed += n
        epoch = self.withheld_epoch.pop(page, None)
        if epoch is not None:
            self.state[page] = PENDING
            self.pending_epoch[page] = epoch
        elif self.state[page] == USED and n:
            self.rebucket(page)

    def cancel_drain(self, page: int) -> None:
        """``page`` leaves the drain because it is being unmapped (or kept backed after an unmap failed):
        its blocks count as free again, its state is the caller's to set."""
        if self.drain[page]:
            self.withheld_epoch.pop(page, None)
            self.unwithhold(page)

    def cap(self, page: int) -> int:
        return self._last_cap if page == self.npages - 1 else self.bpp

    def is_backed(self, page: int) -> bool:
        return self.state[page] != UNMAPPED

    def live_count(self) -> int:
        """Live blocks, the null block included: every block not free on a backed, in-flight or unmapped
        page (derived, so that alloc and free update one counter, not two)."""
        inflight = sum(len(self.geo.blocks_of(p)) for pages in self.inflight.values() for p in pages)
        return self.nb - self.free_backed - self.withheld_free - self.unmapped_blocks - inflight

    def pop_unmapped(self) -> int:
        page = self.unmapped.pop()
        self.unmapped_blocks -= self.cap(page)
        return page

    def pop_unmapped_for(self, blocks: int) -> list[int]:
        """Pop unmapped pages until they hold ``blocks <= unmapped_blocks`` blocks."""
        pages: list[int] = []
        capacity = 0
        while capacity < blocks:
            pages.append(self.pop_unmapped())
            capacity += self.cap(pages[-1])
        return pages

    def unpop_unmapped(self, pages: list[int]) -> None:
        """Undo ``_pop_unmapped`` calls that returned ``pages`` (in that order): the stack is as before."""
        self.unmapped.extend(reversed(pages))
        self.unmapped_blocks += sum(self.cap(p) for p in pages)

    def push_unmapped(self, pages: list[int]) -> None:
        """Pages back to the unmapped stack, lowest id on top (so it is mapped again first)."""
        self.unmapped.extend(sorted(pages, reverse=True))
        self.unmapped_blocks += sum(self.cap(p) for p in pages)

    def take_unmapped(self, page: int) -> None:
        """Take a given page off the unmapped stack (the null block's page, before it is backed)."""
        self.unmapped.remove(page)
        self.unmapped_blocks -= self.cap(page)

    def hold_null(self, block: int) -> None:
        """The page of ``block``, just backed, is in use with ``block`` live for good (the null block:
        never freed) and the page's other blocks free. The book holds no other backed page yet."""
        page = block // self.bpp
        self.page_free[page] = [b for b in reversed(self.geo.blocks_of(page)) if b != block]
        self.state[page] = USED
        self.live[block] = 2  # live, and never accepted by check_free()
        self.free_backed = len(self.page_free[page])
        self.rebucket(page)

    def issued_blocks(self) -> list[int]:
        """Every issued block id, the null block excluded; O(blocks)."""
        live = self.live
        return [b for b in range(self.nb) if live[b] == 1]

    def defer(self, pages: list[int], epoch: int) -> None:
        """Empty backed pages wait for ``epoch``'s release before they may be unmapped."""
        for p in pages:
            self.state[p] = PENDING
            self.pending_epoch[p] = epoch
            self.pending.append((epoch, p))

    def withhold_emptied(self, pages: list[int], epoch: int) -> None:
        """Emptied draining pages wait for ``epoch``'s release before they are unmapped (never reused)."""
        for p in pages:
            self.state[p] = WITHHELD
            self.withheld_epoch[p] = epoch
            self.pending.append((epoch, p))

    def pop_released(self, epoch: int) -> tuple[list[int], list[int]]:
        """The pending pages and the withheld (draining) pages emptied in epochs <= ``epoch``, no longer
        waiting (still backed, empty; a withheld page still draining)."""
        ready: list[int] = []
        drained: list[int] = []
        pending, pending_epoch, withheld = self.pending, self.pending_epoch, self.withheld_epoch
        while pending and pending[0][0] <= epoch:
            e, p = pending.popleft()
            if pending_epoch.get(p) == e:  # else: reused since, or emptied again later
                del pending_epoch[p]
                ready.append(p)
            elif withheld.get(p) == e and p not in drained:  # queued twice in one epoch: once
                drained.append(p)
        return ready, drained

    def keep_in_reserve(self, pages: list[int]) -> None:
        """Empty backed pages join the reserve."""
        for p in pages:
            self.state[p] = RESERVE
        self.reserve.extend(pages)

    def take_oldest_reserve(self, count: int) -> list[int]:
        """The ``count`` oldest reserve pages, out of the reserve (still backed: the caller unmaps them)."""
        pages = self.reserve[:count]
        del self.reserve[:count]
        return pages

    def jobs_covering(self, blocks: int) -> int:
        """How many of the oldest background maps in flight hold ``blocks`` blocks (0: all of them)."""
        for count, pages in enumerate(self.inflight.values(), 1):
            blocks -= sum(self.cap(p) for p in pages)
            if blocks <= 0:
                return count
        return 0

    def page_to_reserve(self, page: int) -> None:
        """A page just backed: every block of it is free."""
        blocks = self.geo.blocks_of(page)
        self.page_free[page] = list(reversed(blocks))
        self.free_backed += len(blocks)
        self.state[page] = RESERVE
        self.reserve.append(page)

    def rebucket(self, page: int) -> None:
        """File a partly used page under its free count."""
        k = len(self.page_free[page])
        self.page_bucket[page] = k
        self.buckets[k][page] = None
        self.mask |= 1 << k

    def unbucket(self, page: int) -> None:
        k = self.page_bucket[page]
        if k:
            bucket = self.buckets[k]
            del bucket[page]
            if not bucket:
                self.mask &= ~(1 << k)
            self.page_bucket[page] = 0

    def unback(self, pages: list[int]) -> None:
        """Pages the data plane just released: their blocks leave the free count, the pages the buckets."""
        for p in pages:
            self.cancel_drain(p)
            self.unbucket(p)
            self.free_backed -= len(self.page_free[p])
            self.page_free[p] = []
            self.state[p] = UNMAPPED
        self.push_unmapped(pages)

    def check_invariants(self) -> None:
        """Verify every invariant of the module docstring; ``AssertionError`` names the first one broken.

        O(blocks + pages): for tests, soaks and debugging, never on an engine's path."""
        state, free_lists, live = self.state, self.page_free, self.live
        inflight = {p for pages in self.inflight.values() for p in pages}
        assert len(inflight) == self.inflight_pages, "in-flight page count"
        on_lists: set[int] = set()
        unmapped_blocks = withheld = 0
        drain = self.drain
        for p in range(self.npages):
            blocks = self.geo.blocks_of(p)
            st = state[p]
            assert self.cap(p) == len(blocks), f"page {p}: capacity"
            assert self.live_blocks_on(p) == sum(1 for b in blocks if live[b]), f"page {p}: live count"
            assert not drain[p] or st in (USED, WITHHELD), f"{_STATE_NAMES[st]} page {p} is draining"
            assert (st == WITHHELD) == (p in self.withheld_epoch), f"page {p}: withheld state"
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
                assert self.page_bucket[p] == 0, f"draining page {p} is in a bucket"
            elif st == USED:
                assert not empty, f"page {p} in use without live blocks"
                k = len(free)
                assert self.page_bucket[p] == k and (k == 0 or p in self.buckets[k]), f"page {p}: bucket"
            else:
                assert empty, f"{_STATE_NAMES[st]} page {p} has live blocks"
                assert self.page_bucket[p] == 0, f"{_STATE_NAMES[st]} page {p} is in a bucket"
        assert len(on_lists) == self.free_backed, "free block count"
        assert withheld == self.withheld_free, "withheld block count"
        assert sum(drain) == self.drain_count, "draining page count"
        assert unmapped_blocks == self.unmapped_blocks, "unmapped block count"
        assert sorted(self.unmapped) == [p for p in range(self.npages) if state[p] == UNMAPPED], (
            "unmapped stack"
        )
        assert sorted(self.reserve) == [p for p in range(self.npages) if state[p] == RESERVE], "reserve"
        assert sorted(self.pending_epoch) == [p for p in range(self.npages) if state[p] == PENDING], "pending"
        for k, bucket in enumerate(self.buckets):
            assert bool(bucket) == bool(self.mask >> k & 1), f"mask bit {k}"
            assert all(state[p] == USED and len(free_lists[p]) == k and not drain[p] for p in bucket), (
                f"bucket {k}"
            )
