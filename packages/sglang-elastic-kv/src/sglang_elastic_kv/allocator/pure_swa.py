"""SGLang's all-sliding-window (pure SWA) allocator over one elastic pool.

A model whose every attention layer is sliding-window gets SGLang's ``SWAKVPool`` with an empty
full-attention sub-pool (no layers, no memory: :attr:`~sglang_elastic_kv.pool.ElasticKVPool.no_layers`)
and a sliding-window sub-pool holding every layer, and ``PureSWATokenToKVPoolAllocator``: one page_size-1
``TokenToKVPoolAllocator`` over the SWA sub-pool serving as both the "full" and the "SWA" side (the slot
table is the identity). SGLang frees a request's out-of-window tokens while it decodes
(``ScheduleBatch.maybe_evict_swa`` -> ``free_swa``), so the pool's memory follows (window x running
requests) plus what the prefix cache keeps.

:class:`ElasticPureSWAAllocator` subclasses SGLang's allocator and keeps its logic (its free group,
frees, SWA eviction); what changes:

* the one sub-allocator is :class:`~sglang_elastic_kv.allocator.base.ElasticTokenToKVPoolAllocator` over the
  same sub-pool (registry record ``<name>-swa``), so every slot SGLang receives is backed;
* the scheduler's capacity hooks (admission budget, decode capacity, eviction) see what the pool can back
  now; ``available_size`` and its ``full_`` / ``swa_`` faces stay logical for SGLang's idle leak check;
* SGLang opens free groups on the composite (the sub-allocator never sees one), so the composite gives
  the sub-allocator's ledger its release epoch and step housekeeping at the group's start and end.
"""

from __future__ import annotations

from typing import Any

import torch
from elastic_kv.errors import ConfigError
from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.prefill_budget import SWAPrefillBudget
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from sglang_elastic_kv import compat
from sglang_elastic_kv.allocator.base import evict_shortfall
from sglang_elastic_kv.allocator.composite import ElasticCompositeMixin
from sglang_elastic_kv.allocator.swa import ElasticSWAPrefillBudget
from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator
from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

__all__ = ["ElasticPureSWAAllocator"]


class ElasticPureSWAAllocator(ElasticCompositeMixin, PureSWATokenToKVPoolAllocator):
    """``PureSWATokenToKVPoolAllocator`` whose one sub-allocator is elastic; constructed with the in-tree
    arguments (the allocator builder hook rebuilds SGLang's instance with them)."""

    swa_attn_allocator: Any
    full_attn_allocator: Any

    def __init__(
        self,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Any,
        need_sort: bool,
    ) -> None:
        if not isinstance(kvcache, SWAKVPool) or not isinstance(kvcache.swa_kv_pool, ElasticMHATokenToKVPool):
            raise ConfigError(
                "--kv-cache-backend=elastic serves all-sliding models over SGLang's SWAKVPool with an "
                f"elastic MHA sub-pool, not {type(kvcache).__name__}; use --kv-cache-backend=native"
            )
        super().__init__(size_swa, page_size, dtype, device, kvcache, need_sort)
        compat.check_instance(self, "sglang.srt.mem_cache.allocator.swa.PureSWATokenToKVPoolAllocator")
        elastic = ElasticTokenToKVPoolAllocator(size_swa, dtype, device, kvcache.swa_kv_pool, need_sort)
        self.swa_attn_allocator = elastic
        elastic.elastic_holds_sequence = False  # every layer keeps its window only
        self.full_attn_allocator = elastic
        elastic.clear()

    # -- physical capacity: what the scheduler's hooks see ------------------------------------------

    def elastic_full_available_size(self) -> int:
        """Slots an allocation can get now (the one pool serves both faces)."""
        return int(self.swa_attn_allocator.elastic_available_size())

    elastic_swa_available_size = elastic_full_available_size

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> SWAPrefillBudget:
        """SGLang's all-SWA admission budget over backable headroom (:class:`ElasticSWAPrefillBudget`)."""
        return ElasticSWAPrefillBudget(
            self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens, all_swa=True
        )

    def elastic_evict(self, tree_cache: Any, num_tokens: int = 0, max_cached_tokens: int = 0) -> None:
        """Evict prefix-cache entries as :func:`~.base.evict_shortfall` says for the one pool (plain
        ``evict``, the count on both faces as SGLang's own all-SWA path asks)."""
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        count = evict_shortfall(
            self.swa_attn_allocator, int(tree_cache.evictable_size()), num_tokens, max_cached_tokens
        )
        if count:
            tree_cache.evict(EvictParams(num_tokens=count, swa_num_tokens=count))

    def elastic_parts(self) -> tuple[Any, ...]:
        """The one elastic allocator under both faces."""
        return (self.swa_attn_allocator,)
