"""What the elastic SGLang allocators share: capacity as SGLang's scheduler sees it, eviction, the decode
promise, and the per-step ledger housekeeping (:class:`ElasticAllocatorMixin`); the admission budget.

Every elastic allocator subclasses SGLang's own and keeps its free lists, kernels and free-group handling;
what changes is that the free list holds only slots that are *backed*, and that backing is taken from and
returned to the ledger (:class:`elastic_kv.ledger.Ledger`), which maps pages before it hands a block out.
So every index SGLang receives points at backed memory. The kinds, one module each as in SGLang's
``mem_cache/allocator/``: :mod:`.token` (page_size 1), :mod:`.paged` (page_size > 1), :mod:`.swa` (hybrid
sliding window: two pools) and :mod:`.pure_swa` (all sliding: one pool), the last two sharing
:mod:`.composite`.

Capacity has two faces. ``available_size()`` stays *logical* (free slots whether backed or not), because
SGLang's idle leak check requires ``available + evictable + ... == max_total_num_tokens``.
:meth:`ElasticAllocatorMixin.elastic_available_size` is what can be backed *now* (free backed slots plus
what the ledger can still map under its limit), and it is what the scheduler's capacity hooks see:
``create_prefill_budget`` (admission), ``check_decode_capacity`` (retraction) and
``evict_to_free_tokens`` (prefix-cache eviction). So physical pressure makes SGLang defer or retract, as
it does when its own pool is full. Each admission pass reads the headroom outside the pool afresh
(:func:`refresh_headroom`), so ``alloc`` returning None (which SGLang treats as fatal) happens only if
another pool takes the device's budget within that pass, between the check and the allocation.

The decode check goes further: it *backs* what the next decode step allocates and keeps it until that
allocation (:meth:`ElasticAllocatorMixin.elastic_promise`). Between the two, SGLang frees out-of-window
tokens in a free group of its own (``maybe_evict_swa``), whose end runs the pool's step housekeeping; that
housekeeping (withholding free slots on draining pages, returning empty chunks) must not take back what
the check promised, or the allocation fails after the check passed.

Eviction has one path, :func:`evict_shortfall` per pool side, used by the capacity hooks and by the
plugin's own hooks (a request's release, a retraction, an idle pool over its limit) alike.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from elastic_kv.errors import ConfigError
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from sglang_elastic_kv import compat, drain
from sglang_elastic_kv.pool import ElasticKVPool

__all__ = [
    "ElasticAllocatorMixin",
    "ElasticPrefillBudget",
    "evict_shortfall",
    "refresh_headroom",
    "room_after_eviction",
]

logger = logging.getLogger(__name__)


def refresh_headroom(allocator: Any) -> None:
    """Before an admission pass: each elastic part re-reads the headroom outside its pool (other pools'
    charges under the device's budget, the driver's free memory): an ``alloc`` that fails after admission
    is fatal to SGLang, and the last reading may be older than another pool's charge."""
    for part in allocator.elastic_parts():
        part.elastic_refresh_room()


def room_after_eviction(backable: int, evictable: int, limit_room: int | None) -> int:
    """Slots an allocation can count on once ``evictable`` cached slots are evicted, given ``backable`` slots
    it can get now and ``limit_room`` (:meth:`ElasticAllocatorMixin.elastic_limit_room`; None: no limit).

    Evicting frees the cached slots' blocks; within the pool's limit they can be reused (or backed again),
    but while the pool is over its limit (``kvctl`` lowered it) the ledger unmaps emptied pages instead, so
    eviction only helps up to the limit. What is backable now always remains usable.
    """
    if limit_room is None:
        return backable + evictable
    return max(backable, min(backable, limit_room) + evictable)


def evict_shortfall(part: Any, evictable: int, num_tokens: int = 0, max_cached_tokens: int = 0) -> int:
    """Cached tokens to evict from the side of the prefix cache that ``part`` (an elastic allocator) backs,
    which holds ``evictable`` unlocked ones: every one while the pool is over its limit (cached entries
    would keep its draining pages backed, and a retracted request would match its own prefix there
    again), else what ``num_tokens`` lacks of backable room or what the cache holds beyond
    ``max_cached_tokens`` (0: no bound), whichever is more."""
    if evictable <= 0:
        return 0
    if part.elastic_over_limit():
        return evictable
    short = num_tokens - part.elastic_available_size() if num_tokens > 0 else 0
    if max_cached_tokens > 0:
        short = max(short, evictable - max_cached_tokens)
    return max(0, min(short, evictable))


class ElasticPrefillBudget(PrefillBudget):
    """SGLang's prefill budget with the allocator's *backable* headroom in place of its logical one, and,
    for a Mamba / linear hybrid, a count of the new requests whose state slots can be backed: SGLang
    0.5.23 gates those only in its unified Mamba pool (``rem_mamba_slots``) and treats a state slot it
    cannot get at allocation as fatal, so without the count a device budget below the states' need
    would crash the engine instead of making requests wait."""

    def __init__(self, allocator: Any, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> None:
        super().__init__(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        compat.check_instance(self, "sglang.srt.mem_cache.prefill_budget.PrefillBudget")
        # One budget serves one scheduling pass, during which nothing is allocated: read the limit once.
        refresh_headroom(allocator)
        self._limit_room = allocator.elastic_limit_room()
        self._requests_room: int | None = allocator.elastic_admission_room(tree_cache)

    def _admits_another(self) -> bool:
        return self._requests_room is None or self._requests_room > 0

    def has_capacity(self) -> bool:
        """SGLang's token check, and room for another request's state (hybrids)."""
        return self._admits_another() and bool(super().has_capacity())

    def check_prefill(self, **kwargs: Any) -> tuple[bool, int | None]:
        """A new request: refused while no state slot can be backed for it, else SGLang's token check."""
        if not self._admits_another():
            return False, None
        result: tuple[bool, int | None] = super().check_prefill(**kwargs)
        return result

    def can_allocate_prefill(self, **kwargs: Any) -> bool:
        """The same gate on SGLang's other admission path (requests with ``ignore_eos`` and no cache)."""
        return self._admits_another() and bool(super().can_allocate_prefill(**kwargs))

    def reserve(self, extend_input_len: int, max_new_tokens: int, **kwargs: Any) -> None:
        """SGLang's reservation; a new request (not a chunk of one already running) takes its state."""
        super().reserve(extend_input_len, max_new_tokens, **kwargs)
        if self._requests_room is not None and not kwargs.get("is_chunked_continuation", False):
            self._requests_room -= 1

    def _available_and_evictable(self) -> int:
        # The parent adds the tree cache's evictable tokens to allocator.available_size(); keep its
        # evictable term (it knows which cache counter applies) and swap the logical term for the physical.
        evictable = super()._available_and_evictable() - self.allocator.available_size()
        return room_after_eviction(self.allocator.elastic_available_size(), evictable, self._limit_room)


class ElasticAllocatorMixin:
    """Scheduler-facing capacity hooks shared by both elastic allocators (see the module docstring)."""

    _kvcache: Any
    # The elastic pool whose ledger backs the slots: the KV pool itself, or the full-attention pool inside
    # SGLang's ``HybridLinearKVPool`` (Mamba / linear-attention hybrids keep their state in the request pool).
    _elastic_pool: Any

    def _ledger_of(self, kvcache: Any) -> Any:
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

        if isinstance(kvcache, HybridLinearKVPool):
            compat.check_instance(kvcache, "sglang.srt.mem_cache.memory_pool.HybridLinearKVPool")
            kvcache = kvcache.full_kv_pool
        self._elastic_pool = kvcache
        if not isinstance(kvcache, ElasticKVPool) or kvcache.elastic is None:
            raise ConfigError(
                f"--kv-cache-backend=elastic needs an elastic KV pool under the allocator, got "
                f"{type(kvcache).__name__}: this model's KV pool kind is not supported"
            )
        if kvcache.plugin_config is not None:
            self._maintain_interval_s = kvcache.plugin_config.maintain_interval_s
        return kvcache.elastic.ledger

    _ledger: Any
    page_size: int  # SGLang's allocator's (1 for the token allocator)
    # Allocators of other elastic memory of this scheduler that follow this one's steps (a hybrid
    # model's Mamba slot allocator, :mod:`sglang_elastic_kv.mamba`).
    _attached: tuple[Any, ...] = ()
    _prev_epoch: int = 0
    _asleep: bool = False
    _maintain_interval_s: float = 0.0
    _maintained_at: float = float("-inf")
    # The scheduler's running requests (:meth:`elastic_follow`); None: no scheduler (unit tests), so no
    # request is retracted for a drain.
    _running: drain.RunningRequests | None = None
    # Request-to-token slots -> this pool's slots, where they differ (a hybrid's SWA side); None: the same.
    elastic_translate: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Whether this pool holds every token of a request (False: a sliding window's pool holds its window),
    # so that a request's whole length must fit its ceiling (sglang_elastic_kv.fit).
    elastic_holds_sequence: bool = True
    # Free pages (slots at page_size 1) the last decode check backed for the coming decode allocation
    # (:meth:`elastic_promise`); housekeeping leaves that many in the free list until then.
    _promised: int = 0

    def elastic_follow(self, running: drain.RunningRequests) -> None:
        """Steer a lowered limit's drain by the scheduler's ``running`` requests (:mod:`.drain`): the ledger
        chooses the pages the requests SGLang retracts first hold, and decode capacity is refused while
        requests SGLang's retraction can reach hold slots on draining pages."""
        self._running = running
        self._ledger.drain_order = functools.partial(drain.drain_order, self, running)

    def elastic_parts(self) -> tuple[ElasticAllocatorMixin, ...]:
        """The elastic allocators behind this one (composites have several): itself."""
        return (self,)

    def elastic_must_retract(self, requests: Any) -> bool:
        """Whether SGLang should retract one of ``requests`` (the decode batch, or what its retraction loop
        keeps) for the drain (:func:`.drain.must_retract`)."""
        if self._running is None or requests is None:
            return False
        return drain.must_retract(self, requests, self._running()[1])

    def elastic_note_retracted(self, requests: int) -> None:
        """SGLang retracted ``requests`` decode requests (their KV freed, to be recomputed): counted as
        the pool's preemptions, which ``kvctl limit --wait`` reports."""
        self._ledger.note_preempted(requests)

    def elastic_sleep(self) -> None:
        """The engine released its KV memory (``release_memory_occupation``) and is idle: unmap the
        ledger's reserve, release the physical handles the data plane caches for reuse, and stop idle
        housekeeping from mapping a reserve again until :meth:`elastic_wake`. Only the null page stays."""
        self._asleep = True
        self._ledger.release_through(self._ledger.epoch)
        self._ledger.settle()  # background maps queued so far join the reserve, which trim then unmaps
        self._ledger.trim()
        released = self._elastic_pool.elastic.release_cached_handles()
        logger.info("elastic KV pool asleep: reserve unmapped, %d cached handle bytes released", released)
        self._elastic_pool.elastic.publish()
        for other in self._attached:
            other.elastic_sleep()

    def elastic_wake(self) -> None:
        """The engine resumed its KV memory: blocks are mapped on demand again."""
        self._asleep = False
        for other in self._attached:
            other.elastic_wake()

    def elastic_admission_room(self, tree_cache: Any) -> int | None:
        """New requests the memory attached to this allocator (a hybrid's state slots) can take now; None
        where nothing is attached."""
        rooms = [int(other.elastic_admission_room(tree_cache)) for other in self._attached]
        return min(rooms) if rooms else None

    def elastic_attach(self, other: Any) -> None:
        """Drive ``other`` (``elastic_step_begin/_end``, ``elastic_idle_check``, ``elastic_sleep/_wake``)
        from this allocator's free groups, idle checks and sleep/wake."""
        if not any(other is known for known in self._attached):
            self._attached = (*self._attached, other)

    def elastic_available_size(self) -> int:
        """Token slots an allocation can get now without unmapped memory running out (<= available_size)."""
        raise NotImplementedError

    def elastic_over_limit(self) -> bool:
        """True while the pool holds more than its limit (``kvctl`` lowered it): it is shrinking."""
        return self._ledger.over_limit()

    def elastic_refresh_room(self) -> None:
        """Re-read the headroom outside the pool (:meth:`elastic_kv.ledger.Ledger.refresh_room`)."""
        self._ledger.refresh_room()

    def elastic_limit_room(self) -> int | None:
        """Token slots the pool could hold beyond its live blocks under its own limit (negative while it is
        over the limit and shrinking); None when the pool has no limit. Page-granular, so an estimate."""
        snap = self._ledger.snapshot()
        if not snap.limit_bytes or not snap.page_bytes:
            return None
        cap_blocks = snap.limit_bytes // snap.page_bytes * snap.blocks_per_page
        # The null block shares page 0 with others but is never counted as used.
        live = snap.used_blocks + (self._ledger.null_block is not None)
        return (cap_blocks - live) * int(self._elastic_pool.rows_per_block)

    # -- once per engine step: SGLang opens a free group around every batch result it processes --------

    def free_group_begin(self) -> None:
        """SGLang's free group, and :meth:`elastic_step_begin`."""
        super().free_group_begin()  # type: ignore[misc]
        self.elastic_step_begin()

    def free_group_end(self) -> None:
        """SGLang's frees, then :meth:`elastic_step_end`."""
        super().free_group_end()  # type: ignore[misc]
        self.elastic_step_end()

    def elastic_step_begin(self) -> None:
        """A new release epoch: GPU work launched before now may still read blocks freed from here on
        (overlap scheduling runs one batch ahead). Called at every free group's start, by this allocator or
        by the composite that owns it (the SWA allocator drives its SWA side without SGLang's free groups)."""
        self._ledger.advance_epoch()
        for other in self._attached:
            other.elastic_step_begin()

    def elastic_step_end(self) -> None:
        """The ledger's step housekeeping, at every free group's end: the batch whose results were processed
        one group ago has finished, so pages emptied before it can be unmapped; reserve, limit, snapshot."""
        self._ledger.release_through(self._prev_epoch)
        self._prev_epoch = self._ledger.epoch
        for other in self._attached:
            other.elastic_step_end()
        # Housekeeping costs tens of microseconds; a fast step (a small model on a CPU) need not pay it
        # every time. Allocation never depends on it: the ledger maps synchronously when its reserve is dry.
        now = time.monotonic()
        if now - self._maintained_at >= self._maintain_interval_s:
            self._maintained_at = now
            self._ledger.maintain()
        self._follow_drain()
        # A promise outlives at most one free group: the one SGLang opens between its decode check and
        # the allocation (maybe_evict_swa). Past it, no allocation is coming for it.
        self._promised = 0

    def elastic_promise(self, num_tokens: int) -> bool:
        """The decode check found the next step's ``num_tokens`` can be had: back them now, after the
        drain's withholding (:meth:`_follow_drain`, which would otherwise take free slots on draining pages
        from the list between the check and the allocation), and keep them for that allocation. False,
        with nothing taken, when they cannot be backed now (SGLang then retracts)."""
        self._promised = 0
        self._follow_drain()
        pages = -(-num_tokens // self.page_size)
        if not self.ensure_backed(pages):
            return False
        self._promised = pages
        return True

    def _follow_drain(self) -> None:
        """Keep free backed slots on draining pages from being handed out (the ledger withholds only the
        blocks it has not issued yet), and give such slots back once the drain ends."""
        raise NotImplementedError

    def verify_byte_accounting(self) -> list[str]:
        """SGLang's idle-time diagnostic (runs on every idle scheduler pass): idle means no GPU work, so
        every pending page may be released and the ledger's housekeeping (``kvctl`` limit and trim,
        reserve, snapshot) runs; returns violations when the ledger's live blocks disagree with the
        blocks this allocator holds, or the pool is inconsistent."""
        self._ledger.release_through(self._ledger.epoch)
        self._promised = 0  # idle: no allocation is coming
        if not self._asleep:
            self._ledger.maintain()
            self._follow_drain()
        held = self._held_blocks()
        used = self._ledger.used_blocks
        problems = (
            [f"elastic KV ledger has {used} live blocks, the allocator holds {held}"] if held != used else []
        )
        for other in self._attached:
            problems += other.elastic_idle_check()
        return problems

    def _held_blocks(self) -> int:
        raise NotImplementedError

    def ensure_backed(self, num_pages: int) -> bool:
        """Make the free list hold at least ``num_pages`` backed SGLang pages (token slots at page_size 1),
        taking blocks from the ledger as needed; False (with nothing taken) when it cannot back them now.
        Lets a composite allocator back all of its parts before it lets any of them allocate."""
        raise NotImplementedError

    def give_back_unused(self) -> None:
        """Return to the ledger every block this allocator holds none of whose slots SGLang holds (backed
        by :meth:`ensure_backed` but never handed out). A composite allocator calls it to undo the backing
        of one part when another part cannot back its share, so a failed allocation takes nothing."""
        raise NotImplementedError

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> PrefillBudget:
        """Admission budget over backable headroom (see :class:`ElasticPrefillBudget`)."""
        return ElasticPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def elastic_withdraw_promise(self) -> None:
        """Undo :meth:`elastic_promise` (a composite's other side could not back its share): what it
        backed ahead of use goes back to the ledger."""
        self._promised = 0
        self.give_back_unused()

    def elastic_evict(self, tree_cache: Any, num_tokens: int = 0, max_cached_tokens: int = 0) -> None:
        """Evict unlocked prefix-cache entries as :func:`evict_shortfall` says (room for ``num_tokens``,
        everything while over the limit, the bound ``max_cached_tokens``).

        Uses the cache's plain ``evict``: its allocation-driven variant measures the shortfall against the
        allocator's logical size, which an elastic pool may satisfy while its memory is short.
        """
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        count = evict_shortfall(self, int(tree_cache.evictable_size()), num_tokens, max_cached_tokens)
        if count:
            tree_cache.evict(EvictParams(num_tokens=count))

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> bool | None:
        """SGLang's eviction before an allocation: :meth:`elastic_evict` for ``num_tokens``."""
        self.elastic_evict(tree_cache, num_tokens)
        return None

    def check_decode_capacity(
        self, *, num_tokens: int, tree_cache: Any, requests: Any = None, spec_algorithm: Any = None
    ) -> bool:
        """Whether the next decode step's ``num_tokens`` are backed after eviction (and kept for it:
        :meth:`elastic_promise`), and no request of ``requests`` must be retracted for a drain
        (:meth:`elastic_must_retract`); False -> retract."""
        self.elastic_evict(tree_cache, num_tokens)
        if self.elastic_must_retract(requests):
            self._promised = 0
            return False
        return self.elastic_promise(num_tokens)
