"""``ElasticKVCacheManager``: vLLM's ``KVCacheManager`` whose ``allocate_slots`` is admitted by the pool.

vLLM's ``allocate_slots`` first checks ``block_pool.get_num_free_blocks()`` against what the request needs
and returns ``None`` -- before changing anything -- when it does not fit; the scheduler then preempts or
keeps the request waiting. Allocation after that check must not fail, and with an elastic pool the check
counts blocks that still have to be backed. So every call runs inside ``ElasticBlockPool.admission(bound)``
with an upper bound on the blocks the call can take: the pool backs that many first, or, if it cannot,
counts only backed blocks, and vLLM's own check then turns the shortage into a normal scheduler miss. No
state has to be rolled back, because nothing was changed before the check.

The bound: per KV cache group, ``cdiv(new + lookahead + external + encoder tokens, block size) + 2`` (one
block for a partial block boundary, one for a copy-on-write of a partially hit prefix block). On the
decode path the pool's backed free blocks cover it and admission costs two integer reads.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheManager

from vllm_elastic_kv.block_pool import ElasticBlockPool

__all__ = ["ElasticKVCacheManager", "admission_bound"]

_TOKEN_ARGS = ("num_new_tokens", "num_lookahead_tokens", "num_external_computed_tokens", "num_encoder_tokens")
# Positions of those parameters after (self, request) in this vLLM's allocate_slots.
_PARAMS = list(inspect.signature(KVCacheManager.allocate_slots).parameters)[2:]
_POSITIONS = {name: _PARAMS.index(name) for name in _TOKEN_ARGS if name in _PARAMS}
# Keyword arguments of the decode-path call that do not change the bound beyond num_lookahead_tokens.
_FAST_KWARGS = frozenset({"num_lookahead_tokens"}) if _PARAMS[:1] == ["num_new_tokens"] else frozenset()


def admission_bound(block_sizes: list[int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Most blocks one ``allocate_slots(request, *args, **kwargs)`` call can take from the pool."""
    tokens = 0
    for name, pos in _POSITIONS.items():
        value = kwargs[name] if name in kwargs else args[pos] if pos < len(args) else 0
        tokens += int(value or 0)
    return sum(-(-tokens // size) + 2 for size in block_sizes)


class ElasticKVCacheManager(KVCacheManager):
    """vLLM's ``KVCacheManager``; constructed by vLLM's scheduler (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._block_sizes = [int(m.block_size) for m in self.coordinator.single_type_managers]

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``allocate_slots`` under the pool's admission (see the module docstring)."""
        pool = self.block_pool
        if not isinstance(pool, ElasticBlockPool) or pool.ledger is None:
            return super().allocate_slots(request, *args, **kwargs)
        ledger = pool.ledger
        if len(args) == 1 and _FAST_KWARGS.issuperset(kwargs):
            # The scheduler's running-request call: allocate_slots(request, n, num_lookahead_tokens=k).
            tokens = args[0] + kwargs.get("num_lookahead_tokens", 0)
            bound = sum(-(-tokens // size) + 2 for size in self._block_sizes)
        else:
            bound = admission_bound(self._block_sizes, args, kwargs)
        if ledger.free_backed_blocks + pool.free_block_queue.num_free_blocks >= bound:
            return super().allocate_slots(request, *args, **kwargs)  # backed already: nothing to do
        with pool.admission(bound):
            return super().allocate_slots(request, *args, **kwargs)
