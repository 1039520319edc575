"""``ElasticKVCacheManager``: vLLM's ``KVCacheManager`` whose ``allocate_slots`` is admitted by the pool.

vLLM's ``allocate_slots`` first checks ``block_pool.get_num_free_blocks()`` against what the request needs
and returns ``None`` -- before changing anything -- when it does not fit; the scheduler then preempts or
keeps the request waiting. Allocation after that check must not fail, and with an elastic pool the check
counts blocks that still have to be backed. So every call runs inside ``ElasticBlockPool.admission(bound)``
with an upper bound on the blocks the call can take: the pool backs that many first, or, if it cannot,
counts only backed blocks, and vLLM's own check then turns the shortage into a normal scheduler miss. No
state has to be rolled back, because nothing was changed before the check.

The bound: per KV cache group, ``cdiv(new + lookahead + external + encoder tokens, block size) + 2`` (one
block for a partial block boundary, one for a copy-on-write of a partially hit prefix block). When the
backed free blocks cover the bound, nothing else happens (an integer comparison). Otherwise vLLM's call is
first tried counting backed free blocks only -- most calls (decode steps that need no new block) succeed
right there, without mapping or evicting -- and only if vLLM says no, admission backs the bound and vLLM's
call runs again. vLLM changes nothing before it returns ``None`` (it only drops blocks that left a sliding
window, which a second call does not repeat), and its own scheduler retries ``allocate_slots`` the same
way between preemptions.
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
        # One KV cache group (the models served today): the decode-path bound without a loop.
        self._one_size = self._block_sizes[0] if len(self._block_sizes) == 1 else 0
        pool = self.block_pool
        self._pool: ElasticBlockPool | None = pool if isinstance(pool, ElasticBlockPool) else None

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``allocate_slots`` under the pool's admission (see the module docstring)."""
        pool = self._pool
        ledger = pool.ledger if pool is not None else None
        if pool is None or ledger is None:
            return super().allocate_slots(request, *args, **kwargs)
        if self._one_size and len(args) == 1 and (not kwargs or _FAST_KWARGS.issuperset(kwargs)):
            # The scheduler's running-request call: allocate_slots(request, n, num_lookahead_tokens=k).
            tokens = args[0] + kwargs.get("num_lookahead_tokens", 0) if kwargs else args[0]
            bound = -(-tokens // self._one_size) + 2
        else:
            bound = admission_bound(self._block_sizes, args, kwargs)
        if ledger.free_backed_blocks >= bound:
            return super().allocate_slots(request, *args, **kwargs)  # backed already: nothing to do
        # The bound overestimates (most decode calls need no block at all): first try with the backed free
        # blocks only; vLLM returns None before changing anything if they do not suffice, and retrying
        # allocate_slots after a None is what vLLM's own scheduler does between preemptions.
        pool.backed_only = True  # a flag, not a context manager: this runs per request per step
        try:
            blocks = super().allocate_slots(request, *args, **kwargs)
        finally:
            pool.backed_only = False
        if blocks is not None:
            return blocks
        with pool.admission(bound):
            return super().allocate_slots(request, *args, **kwargs)
