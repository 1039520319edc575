"""``ElasticBlockPool``: vLLM's ``BlockPool``, drawing free block ids from the elastic ledger.

vLLM's block pool keeps every free block in one LRU queue: never-cached blocks at the front (reused
first), blocks that still hold a prefix-cache entry at the back (evicted last). This subclass keeps all of
vLLM's machinery -- the ``KVCacheBlock`` objects, the hash map, ``touch``/ref counts, the null block, KV
events, metrics, reuse watchers -- and changes one thing: **a block with nothing worth keeping belongs to
the ledger, not to the queue.** So

* ``free_block_queue`` holds only blocks whose contents are still wanted (cached prefix blocks, blocks
  released with ``unpin_blocks``): exactly vLLM's eviction candidates, in vLLM's LRU order;
* the ledger (:class:`elastic_kv.ledger.Ledger`) holds every other free id, issues them
  page-affinely and backs or releases the pages;
* free capacity = the ledger's ``available_size()`` (free blocks it can back now, within the physical
  limit) + the eviction candidates. Cached blocks count as free, as natively: reusing one in place never
  needs memory.

``get_new_blocks`` asks the ledger first (keeps the cache, as vLLM prefers never-cached blocks), then
evicts the least recently used cached blocks; it places the chosen blocks at the front of vLLM's queue and
lets vLLM's own ``get_new_blocks`` hand them out, so eviction events, metrics and watchers are vLLM's.
``free_blocks`` is vLLM's; the never-cached blocks it puts at the front of the queue go back to the
ledger.

Admission (:meth:`admission`, used by ``ElasticKVCacheManager.allocate_slots``) makes pool exhaustion a
scheduler miss without any rollback: before vLLM checks whether a request fits, the pool makes sure that
as many blocks as the call can possibly take are backed (mapping now if needed). If they cannot all be,
it backs what the physical headroom allows and reports exactly what is backed for the rest of the call,
so vLLM's own check returns ``None`` when the request does not fit and the scheduler preempts or waits --
exactly as with a full native pool -- before anything was changed.

Trimming (:meth:`trim_cached`) returns memory held by the prefix cache: it evicts cached blocks only from
pages whose every live block is a cached one, least recently used pages first, because evicting a cached
block on a page that also holds a running request's block frees no memory. While the ledger drains pages
to meet a lowered limit, cached blocks on those pages are evicted as soon as no request holds them
(:meth:`evict_draining`), so they are neither kept nor handed out again.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from elastic_kv.errors import PoolExhausted
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from vllm_elastic_kv import compat

if TYPE_CHECKING:
    from elastic_kv.ledger import Ledger

__all__ = ["ElasticBlockPool", "owned_by"]

# vLLM's own method, called directly: it runs for every new block, and a super() lookup is a measurable share.
_vllm_get_new_blocks = BlockPool.get_new_blocks

logger = logging.getLogger(__name__)


class ElasticBlockPool(BlockPool):
    """See the module docstring. Constructed by vLLM (same arguments as ``BlockPool``); :meth:`attach`
    connects the ledger before the first allocation."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        compat.check_instance(self, "vllm.v1.core.block_pool.BlockPool")
        # vLLM queued every block; ours holds only blocks worth keeping, and there are none yet.
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue([])
        compat.check_instance(self.free_block_queue, "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue")
        self.ledger: Ledger | None = None
        self._stash: list[int] = []  # ids taken from the ledger by admission, not yet handed out
        self._strict = False  # admission could not back its bound: count held blocks only
        self._native_count = False  # reset_prefix_cache: count free blocks as vLLM does
        # True while the scheduler schedules a step, and around the first try of an admission: only blocks
        # the pool holds count (free on backed pages, cached), so an allocation that fits needs no new page.
        self.backed_only = False

    def attach(self, ledger: Ledger) -> None:
        """Connect the ledger; its null block must be vLLM's (block 0), its blocks these blocks."""
        if ledger.geometry.num_blocks != self.num_gpu_blocks:
            raise ValueError(
                f"ledger has {ledger.geometry.num_blocks} blocks, the pool {self.num_gpu_blocks}"
            )
        if ledger.null_block != self.null_block.block_id:
            raise ValueError(f"ledger null block {ledger.null_block} != vLLM's {self.null_block.block_id}")
        self.ledger = ledger

    # -- counting -------------------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        """Blocks in vLLM's queue: cached prefix blocks (and unpinned ones), all evictable."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_referenced(self) -> int:
        """Blocks some request holds (ref_cnt > 0), the null block excluded."""
        assert self.ledger is not None
        return self.ledger.used_blocks - self.num_cached - len(self._stash)

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can get now: the ledger's available blocks (backed, or backable within the
        physical limit) plus the evictable cached blocks (see :meth:`admission` for the strict count).

        vLLM asks once per scheduled request, so the most common answer comes first: with ``backed_only``,
        the blocks the pool holds already, free blocks on backed pages and evictable cached ones."""
        if self.backed_only:
            return self.ledger.free_backed_blocks + self.free_block_queue.num_free_blocks  # type: ignore[union-attr]
        ledger = self.ledger
        if ledger is None:
            return super().get_num_free_blocks()
        if self._native_count:
            return self.num_gpu_blocks - 1 - self.num_referenced
        ready = self.free_block_queue.num_free_blocks + len(self._stash)
        return ready + (ledger.free_backed_blocks if self._strict else ledger.available_size())

    def get_usage(self) -> float:
        """Fraction of the (virtual) capacity referenced by requests, as vLLM reports it."""
        if self.ledger is None:
            return super().get_usage()
        total = self.num_gpu_blocks - 1
        return self.num_referenced / total if total else 0.0

    # -- allocation -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def counting(self, backed_only: bool) -> Iterator[None]:
        """Within the block, ``get_num_free_blocks`` counts only the blocks the pool holds (free blocks on
        backed pages, evictable cached blocks), or, with ``backed_only=False``, every block it could get."""
        previous, self.backed_only = self.backed_only, backed_only
        try:
            yield
        finally:
            self.backed_only = previous

    @contextlib.contextmanager
    def admission(self, bound: int, hits: int = 0) -> Iterator[None]:
        """Within the block, up to ``bound`` blocks can be allocated without mapping; if that could not be
        arranged, ``get_num_free_blocks`` counts held blocks only. ``hits``: queued cached blocks the call
        takes as prefix hits, which leave the queue and so cannot be evicted for its new blocks. Unused
        ids go back on exit."""
        ledger = self.ledger
        assert ledger is not None and not self._stash and not self._strict
        if ledger.free_backed_blocks + self.free_block_queue.num_free_blocks - hits < bound:
            # Back what the bound asks for, or as much of it as the physical headroom allows; in the
            # second case vLLM's check must see exactly what is backed.
            want = min(bound, ledger.available_size())
            ids = ledger.alloc(want) if want > 0 else []
            self._stash = ids or []
            self._strict = ids is None or want < bound
        try:
            yield
        finally:
            if self._stash:
                stash, self._stash = self._stash, []
                ledger.free(stash)
            self._strict = False

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """vLLM's ``get_new_blocks``, served from the stash, the ledger, then the LRU cached blocks."""
        ledger = self.ledger
        if ledger is None or num_blocks <= 0:
            return super().get_new_blocks(num_blocks)
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        plain = not self._stash and not self._strict  # outside an admission
        # The common case, a decode step's block: the ledger has it.
        ids = ledger.alloc(num_blocks) if plain else None
        if ids is None:
            ids = self._take_ids(num_blocks, ledger_refused=plain)
        # vLLM's get_new_blocks pops from the front: our fresh blocks, then the oldest cached ones. Every
        # counting mode counts the queue, so its own check sees the blocks just queued.
        blocks = self.blocks
        self.free_block_queue.prepend_n([blocks[i] for i in ids])
        return _vllm_get_new_blocks(self, num_blocks)

    def _take_ids(self, n: int, ledger_refused: bool = False) -> list[int]:
        """``n`` ids: stash first, then the ledger; fewer when cached blocks must cover the rest.
        ``ledger_refused``: ``ledger.alloc(n)`` was just tried (no stash) and answered ``None``."""
        ledger = self.ledger
        assert ledger is not None
        taken = self._stash[:n]
        del self._stash[:n]
        need = n - len(taken)
        if need:
            got = None if self._strict or ledger_refused else ledger.alloc(need)
            if got is None:
                # Physical pressure: what is backed, and evict cached blocks for the rest.
                got = ledger.alloc(min(need, ledger.free_backed_blocks)) or []
            taken += got
            need -= len(got)
            if need > self.free_block_queue.num_free_blocks:
                ledger.free(taken)
                raise PoolExhausted(
                    f"the elastic KV pool cannot provide {n} blocks (admission bound exceeded); "
                    "this is a bug in vllm-elastic-kv's bound on allocate_slots"
                )
        return taken

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], evict_first: bool = False) -> None:
        """vLLM's ``free_blocks``; the never-cached blocks it queues at the front return to the ledger.

        ``evict_first`` (vLLM 0.34+: another tier holds the contents): this pool's blocks freed for good
        leave the prefix cache first, so they return to the ledger like never-cached ones."""
        ledger = self.ledger
        blocks = list(ordered_blocks)
        if evict_first:
            for block in blocks:
                if block.ref_cnt == 1 and not block.is_null and owned_by(block, self):
                    self._maybe_evict_cached_block(block)
        if ledger is None:
            super().free_blocks(blocks)
            return
        super().free_blocks(blocks)
        # Exactly the blocks vLLM prepended: ours, now unreferenced, not the null block, not cached.
        uncached = sum(
            1
            for b in blocks
            if b.ref_cnt == 0
            and not b.is_null
            and owned_by(b, self)
            and (b.block_hash is None or not self.enable_caching)
        )
        self._release(self.free_block_queue.popleft_n(uncached) if uncached else [])
        if ledger.draining:
            self.evict_draining(blocks)  # cached blocks on pages being released are not kept

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        if blocks:
            assert self.ledger is not None
            self.ledger.free([b.block_id for b in blocks])

    def evict_blocks(self, block_ids: set[int]) -> None:
        """vLLM's ``evict_blocks``; evicted blocks nobody references leave the queue for the ledger."""
        super().evict_blocks(block_ids)
        if self.ledger is None:
            return
        freed = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0 and not block.is_null and block.block_hash is None and _queued(block):
                self.free_block_queue.remove(block)
                freed.append(block)
        self._release(freed)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache`` (which succeeds only when no request holds a block); then every
        block returns to the ledger and its reserve is trimmed, so the pool holds only the null page."""
        if self.ledger is None:
            return super().reset_prefix_cache()
        self._native_count = True
        try:
            ok = super().reset_prefix_cache()
        finally:
            self._native_count = False
        if ok:
            self._release(self.free_block_queue.popleft_n(self.free_block_queue.num_free_blocks))
            self.ledger.trim()
        return ok

    # -- returning memory -------------------------------------------------------------------------------
    def trim_cached(self, keep_pages: int = 0) -> int:
        """Evict cached blocks from pages that hold nothing else, least recently used first, keeping
        ``keep_pages`` such pages; returns the number of pages whose blocks went back to the ledger."""
        ledger = self.ledger
        queue = self.free_block_queue
        if ledger is None or not queue.num_free_blocks:
            return 0
        bpp = ledger.geometry.blocks_per_page
        idle = keep_pages <= 0 and self.num_referenced == 0
        if idle:
            # The engine went idle (the common call): no request holds a block, so no cached page holds
            # anything else and the whole queue goes, in one pass. This runs before a burst's last outputs
            # are returned, so it skips sorting blocks by page and forgets the cache at once (_forget_all).
            victims = queue.popleft_n(queue.num_free_blocks)
            pages = len({block.block_id // bpp for block in victims})
        else:
            by_page: dict[int, list[KVCacheBlock]] = {}
            for block in queue.get_all_free_blocks():  # least recently used first
                by_page.setdefault(block.block_id // bpp, []).append(block)
            whole = [page for page, cached in by_page.items() if len(cached) == ledger.live_blocks_on(page)]
            chosen = whole[: max(0, len(whole) - keep_pages)]
            victims = [block for page in chosen for block in by_page[page]]
            for block in victims:
                queue.remove(block)
            pages = len(chosen)
        self._evict_dequeued(victims, forget_all=idle)
        if pages:
            logger.debug("trimmed %d cached pages (%d blocks)", pages, len(victims))
        return pages

    def evict_draining(self, blocks: Iterable[KVCacheBlock] | None = None) -> int:
        """Evict the cached blocks no request holds that lie on pages the ledger is releasing (a lowered
        limit: :mod:`vllm_elastic_kv.scheduler.drain`), so that those pages can empty; among ``blocks`` (just
        freed), or the whole queue. Returns the number of blocks evicted."""
        ledger = self.ledger
        if ledger is None or not ledger.draining:
            return 0
        queue = self.free_block_queue
        bpp = ledger.geometry.blocks_per_page
        candidates = queue.get_all_free_blocks() if blocks is None else blocks
        victims = [
            block
            for block in candidates
            if block.ref_cnt == 0
            and not block.is_null
            and owned_by(block, self)
            and _queued(block)
            and ledger.is_draining(block.block_id // bpp)
        ]
        for block in victims:
            queue.remove(block)
        self._evict_dequeued(victims)
        return len(victims)

    def _evict_dequeued(self, victims: list[KVCacheBlock], forget_all: bool = False) -> None:
        """Cached blocks just taken out of the queue: forget their cache entries (all at once with
        ``forget_all``, see :meth:`_forget_all`), tell reuse watchers, return them to the ledger."""
        if not victims:
            return
        if not (forget_all and self._forget_all(victims)):
            evict = self._maybe_evict_cached_block
            for block in victims:
                evict(block)
        watchers = getattr(self, "_reuse_watchers", None)
        if watchers:
            self._notify_reuse([block for block in victims if block.block_id in watchers])
        self._release(victims)

    def _forget_all(self, blocks: list[KVCacheBlock]) -> bool:
        """Forget every prefix-cache entry at once, ``blocks`` being every block that has one (no request
        holds a block, the whole queue was taken): what vLLM's ``reset_prefix_cache`` does to the hash maps
        and blocks. The idle transition runs before the engine returns a burst's last outputs, and evicting
        thousands of cached blocks one by one would be most of it. False, with nothing done, when something
        observes single evictions (KV cache events, block metrics) or this vLLM keeps its hashes elsewhere:
        the caller evicts then."""
        if self.enable_kv_cache_events or getattr(self, "metrics_collector", None) is not None:
            return False
        by_block = getattr(self, "cached_block_hashes_by_block", None)
        table = getattr(self, "cached_block_hash_to_block", None)
        if not isinstance(by_block, dict) or table is None:
            return False
        self.cached_block_hash_to_block = type(table)()
        by_block.clear()
        for block in blocks:
            block.reset_hash()
        return True


def owned_by(block: KVCacheBlock, pool: BlockPool) -> bool:
    """Whether ``block`` is ``pool``'s: its ``pool`` field (compat.PROBED) names ``pool`` or nothing. The
    field holds the pool itself (0.29-0.33) or a weak reference to it (0.34+)."""
    owner = getattr(block, "pool", None)
    if isinstance(owner, weakref.ref):
        owner = owner()
    return owner is None or owner is pool


def _queued(block: KVCacheBlock) -> bool:
    """Whether ``block`` is linked into a free queue (real queue entries always have both neighbours)."""
    return block.prev_free_block is not None and block.next_free_block is not None
