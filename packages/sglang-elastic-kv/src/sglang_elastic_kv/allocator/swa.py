"""SGLang's hybrid sliding-window (SWA) allocator over two elastic pools.

A hybrid SWA model (interleaved sliding-window and full-attention layers) gets SGLang's ``SWAKVPool``:
a full-attention sub-pool and a smaller sliding-window sub-pool, both built from the platform's MHA pool
class, so both are :class:`~sglang_elastic_kv.pool.ElasticMHATokenToKVPool` (two spaces sets, two ledgers,
two registry records ``<name>-full`` and ``<name>-swa``). SGLang's ``SWATokenToKVPoolAllocator`` drives
them through two sub-allocators and a full -> SWA slot table; SGLang frees a request's out-of-window
tokens on the SWA side while it decodes (``ScheduleBatch.maybe_evict_swa`` -> ``free_swa``), so the SWA
pool's memory stays near (window x running requests) while the full pool follows the sequences.

:class:`ElasticSWATokenToKVPoolAllocator` subclasses SGLang's allocator and keeps its logic (slot table,
free groups, SWA eviction, its kernels); what changes:

* both sub-allocators are the elastic ones (page_size 1 builds ``TokenToKVPoolAllocator`` directly, and
  page_size > 1 asks the platform seam, which a non-hooked process leaves unanswered: either way a plain
  sub-allocator is replaced by the elastic one over the same sub-pool);
* every allocation backs the pages of *both* sides before either side allocates (SGLang asserts that the
  second side succeeds once the first did; a half-done allocation would leak the first side), and a side
  that cannot back its share makes the other give back what it backed: a refused allocation takes nothing;
* the scheduler's capacity hooks (admission budget, decode capacity and eviction) see what each side can
  back now, not the sub-pools' logical sizes; ``full_available_size`` / ``swa_available_size`` stay logical
  because SGLang's idle leak check balances them against the pools' sizes;
* SGLang opens free groups on the composite, which forwards them to the full side only; the SWA side's
  ledger gets its step housekeeping (release epoch, reserve, ``kvctl`` limit, snapshot) from here.

All-sliding models (SGLang's ``PureSWATokenToKVPoolAllocator``) are served by
:mod:`sglang_elastic_kv.allocator.pure_swa`. Not served (ConfigError at start-up): the per-request SWA ring
(DeepSeek-V4-style pools) and sub-pools that are not elastic MHA pools (MLA-SWA hybrids).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from elastic_kv.errors import ConfigError
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.prefill_budget import SWAPrefillBudget
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.utils import get_num_new_pages

from sglang_elastic_kv import compat
from sglang_elastic_kv.allocator.base import (
    ElasticAllocatorMixin,
    evict_shortfall,
    refresh_headroom,
    room_after_eviction,
)
from sglang_elastic_kv.allocator.composite import ElasticCompositeMixin
from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator
from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator
from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

__all__ = ["ElasticSWAPrefillBudget", "ElasticSWATokenToKVPoolAllocator"]

logger = logging.getLogger(__name__)


class ElasticSWAPrefillBudget(SWAPrefillBudget):
    """SGLang's SWA admission budget over what each side can back now, evictable cached tokens counted
    only up to each pool's limit (:func:`~sglang_elastic_kv.allocator.base.room_after_eviction`). With
    ``all_swa`` (an all-sliding model, one pool) both faces are the SWA side's, as in SGLang's budget."""

    def __init__(
        self, allocator: Any, tree_cache: Any, *, num_mixed_decode_tokens: int = 0, all_swa: bool = False
    ) -> None:
        super().__init__(
            allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens, all_swa=all_swa
        )
        compat.check_instance(self, "sglang.srt.mem_cache.prefill_budget.SWAPrefillBudget")
        # One budget serves one scheduling pass, during which nothing is allocated: read the limits once.
        refresh_headroom(allocator)
        self._full_limit_room = allocator.full_attn_allocator.elastic_limit_room()
        self._swa_limit_room = allocator.swa_attn_allocator.elastic_limit_room()

    def _available_and_evictable(self) -> int:
        if self.all_swa:  # an all-sliding model: the one pool is the SWA side
            return room_after_eviction(
                self.allocator.elastic_swa_available_size(),
                self.tree_cache.swa_evictable_size(),
                self._swa_limit_room,
            )
        return room_after_eviction(
            self.allocator.elastic_full_available_size(),
            self.tree_cache.full_evictable_size(),
            self._full_limit_room,
        )

    @property
    def remaining_swa(self) -> int:
        """SWA tokens admission may still promise: backable now + evictable (within the limit) - promised."""
        room = room_after_eviction(
            self.allocator.elastic_swa_available_size(),
            self.tree_cache.swa_evictable_size(),
            self._swa_limit_room,
        )
        return room - int(self.swa_offset)


class ElasticSWATokenToKVPoolAllocator(ElasticCompositeMixin, SWATokenToKVPoolAllocator):
    """``SWATokenToKVPoolAllocator`` whose full and SWA sub-allocators are elastic; constructed with the
    in-tree arguments (the allocator builder hook rebuilds SGLang's instance with them)."""

    full_attn_allocator: Any
    swa_attn_allocator: Any
    _part_names = ("full", "swa")

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Any,
        need_sort: bool,
        req_to_token_pool: Any = None,
    ) -> None:
        super().__init__(size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool)
        compat.check_instance(self, "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator")
        if self._swa_req_ring:
            raise ConfigError(
                "--kv-cache-backend=elastic does not serve a per-request SWA ring pool "
                f"({type(kvcache).__name__}); use --kv-cache-backend=native"
            )
        if not isinstance(kvcache, SWAKVPool):
            raise ConfigError(
                f"--kv-cache-backend=elastic serves hybrid SWA models over SGLang's SWAKVPool, not "
                f"{type(kvcache).__name__}; use --kv-cache-backend=native"
            )
        compat.check_instance(kvcache, "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool")
        for part, pool in (("full_kv_pool", kvcache.full_kv_pool), ("swa_kv_pool", kvcache.swa_kv_pool)):
            if not isinstance(pool, ElasticMHATokenToKVPool):
                raise ConfigError(
                    f"--kv-cache-backend=elastic serves hybrid SWA models over elastic MHA sub-pools; this "
                    f"model's {part} is {type(pool).__name__} (MLA-SWA and other hybrids are not served)"
                )
        self.full_attn_allocator = self._elastic(self.full_attn_allocator, size, kvcache.full_kv_pool)
        self.swa_attn_allocator = self._elastic(self.swa_attn_allocator, size_swa, kvcache.swa_kv_pool)
        self.swa_attn_allocator.elastic_holds_sequence = False  # the window only
        # The request-to-token table holds full-attention slots; the SWA side's are mapped from them.
        self.swa_attn_allocator.elastic_translate = self.translate_loc_from_full_to_swa
        self.clear()  # SGLang's constructor cleared the sub-allocators it built; these start empty too

    def _elastic(self, sub: Any, size: int, pool: Any) -> ElasticAllocatorMixin:
        """``sub`` if it is elastic, else the elastic allocator of its kind over the same sub-pool."""
        if isinstance(sub, ElasticAllocatorMixin):
            return sub
        if type(sub) is TokenToKVPoolAllocator:
            return ElasticTokenToKVPoolAllocator(size, self.dtype, self.device, pool, self.need_sort)
        if type(sub) is PagedTokenToKVPoolAllocator:
            return ElasticPagedTokenToKVPoolAllocator(
                size, self.page_size, self.dtype, self.device, pool, self.need_sort
            )
        raise ConfigError(
            f"--kv-cache-backend=elastic: SGLang's SWA allocator built {type(sub).__name__} for a sub-pool; "
            "only the in-tree token and paged allocators can be made elastic"
        )

    # -- physical capacity: what the scheduler's hooks see ------------------------------------------

    def elastic_full_available_size(self) -> int:
        """Full-attention slots an allocation can get now (free backed + backable under the limit)."""
        return int(self.full_attn_allocator.elastic_available_size())

    def elastic_swa_available_size(self) -> int:
        """Sliding-window slots an allocation can get now."""
        return int(self.swa_attn_allocator.elastic_available_size())

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> SWAPrefillBudget:
        """Admission budget over backable headroom on both sides (:class:`ElasticSWAPrefillBudget`)."""
        return ElasticSWAPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def elastic_evict(self, tree_cache: Any, num_tokens: int = 0, max_cached_tokens: int = 0) -> None:
        """Evict prefix-cache entries on each side as :func:`~.base.evict_shortfall` says for that side's
        pool (room for ``num_tokens``, everything while over its limit, the bound ``max_cached_tokens``),
        with the cache's plain ``evict``: its allocation-driven variant measures the shortfalls against the
        sub-pools' logical sizes, which an elastic pool may satisfy while memory is short."""
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        full = evict_shortfall(
            self.full_attn_allocator, int(tree_cache.full_evictable_size()), num_tokens, max_cached_tokens
        )
        swa = evict_shortfall(
            self.swa_attn_allocator, int(tree_cache.swa_evictable_size()), num_tokens, max_cached_tokens
        )
        if full or swa:
            tree_cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))

    def elastic_parts(self) -> tuple[ElasticAllocatorMixin, ...]:
        """The elastic allocators this composite drives: the full-attention side, then the SWA side."""
        return (self.full_attn_allocator, self.swa_attn_allocator)

    # -- allocation: back both sides first, then SGLang's allocation ------------------------------------

    def _back_both(self, full_pages: int, swa_pages: int) -> bool:
        """Back ``full_pages`` / ``swa_pages`` pages on the two sides, or neither: when the SWA side cannot
        back its share, the full side gives back what it backed ahead of use, so a refused allocation
        leaves no memory held on either side (its caller returns None; SGLang defers or retracts)."""
        if not self.full_attn_allocator.ensure_backed(full_pages):
            self._log_short("full", self.full_attn_allocator, full_pages)
            return False
        if not self.swa_attn_allocator.ensure_backed(swa_pages):
            self.full_attn_allocator.give_back_unused()
            self._log_short("swa", self.swa_attn_allocator, swa_pages)
            return False
        return True

    def _prepare(self, full_pages: int, swa_pages: int) -> bool:
        """SGLang's own check that both free lists can hold the new pages, then :meth:`_back_both`."""
        return bool(self.new_pages_available(full_pages, swa_pages)) and self._back_both(
            full_pages, swa_pages
        )

    @staticmethod
    def _log_short(part: str, sub: Any, pages: int) -> None:
        # The scheduler's capacity hooks should have deferred or retracted first; this is the race where
        # memory vanished between its check and the allocation (another pool, a lowered limit).
        logger.warning(
            "elastic KV: the %s pool cannot back %d page(s) now (%d slots backable): %s",
            part,
            pages,
            sub.elastic_available_size(),
            sub._ledger.snapshot(),
        )

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """SGLang's page_size-1 ``alloc`` after backing ``need_size`` slots on both sides."""
        if need_size > self.available_size() or not self._back_both(need_size, need_size):
            return None
        result: torch.Tensor | None = super().alloc(need_size)
        return result

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """SGLang's ``alloc_extend`` after backing the new pages on both sides (counted on the CPU; both
        sides page in step, as SGLang's own call passes one count to both)."""
        pages = get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
        )
        if not self._prepare(pages, pages):
            return None
        result: torch.Tensor | None = super().alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        return result

    def alloc_extend_swa_tail(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        swa_tail_len: int,
    ) -> torch.Tensor | None:
        """SGLang's full-plus-SWA-tail allocation (PD decode side) after backing both parts."""
        full = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
        swa = -(-swa_tail_len // self.page_size)
        if not self._prepare(full, swa):
            return None
        result: torch.Tensor | None = super().alloc_extend_swa_tail(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, swa_tail_len
        )
        return result

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """SGLang's paged ``alloc_decode`` after backing, on both sides, a page for every request that
        starts one (SGLang's composite would leak the full side's pages if only the SWA side failed)."""
        pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        if not self._prepare(pages, pages):
            return None
        result: torch.Tensor | None = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        return result
