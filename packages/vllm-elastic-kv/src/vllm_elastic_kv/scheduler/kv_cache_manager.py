"""``ElasticKVCacheManager``: vLLM's ``KVCacheManager`` whose ``allocate_slots`` is admitted by the pool.

vLLM's ``allocate_slots`` first checks ``block_pool.get_num_free_blocks()`` against what the request needs
and returns ``None`` -- before changing anything -- when it does not fit; the scheduler then preempts or
keeps the request waiting. Allocation after that check must not fail, and with an elastic pool the check
counts blocks that still have to be backed. So every call runs inside ``ElasticBlockPool.admission(bound)``
with an upper bound on the blocks the call can take: the pool backs that many first, or, if it cannot,
counts only backed blocks, and vLLM's own check then turns the shortage into a normal scheduler miss. No
state has to be rolled back, because nothing was changed before the check.

The per-request call of a running request, once per scheduled request and step, is the hot path: while
the scheduler schedules a step, the pool counts only the blocks it holds -- free blocks on backed pages and
evictable cached blocks (``ElasticBlockPool.backed_only``, set once per step by the elastic scheduler) -- so
that call goes straight to vLLM and needs the admission below only if vLLM says no.

The bound: per KV cache group, ``cdiv(new + lookahead + external + encoder tokens, block size) + 2`` (one
block for a partial block boundary, one for a copy-on-write of a partially hit prefix block). When the
backed free blocks cover the bound, nothing else happens (an integer comparison). Otherwise vLLM's call is
first tried counting held blocks only -- most calls (decode steps that need no new block) succeed
right there, without mapping or evicting -- and only if vLLM says no, admission backs the bound and vLLM's
call runs again, counting every block the pool could provide. vLLM changes nothing before it returns
``None`` (it only drops blocks that left a sliding window, which a second call does not repeat), and its
own scheduler retries ``allocate_slots`` the same way between preemptions.

Admission backs nothing when the backed free blocks and the evictable cached blocks already cover the
bound. The call's own prefix hits do not count there (``queued_hits``): the call takes them out of the
queue, so they cannot also be evicted for its new blocks.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheManager

from vllm_elastic_kv import compat
from vllm_elastic_kv.scheduler.block_pool import ElasticBlockPool

__all__ = ["ElasticKVCacheManager", "admission_bound", "queued_hits"]

_TOKEN_ARGS = ("num_new_tokens", "num_lookahead_tokens", "num_external_computed_tokens", "num_encoder_tokens")
# Positions of the parameters after (self, request) in this vLLM's allocate_slots. A name it lacks reads as
# not passed: compat names a missing parameter at start-up, and an import must not fail before that.
_POSITIONS = {
    name: pos
    for pos, name in enumerate(list(inspect.signature(KVCacheManager.allocate_slots).parameters)[2:])
}
# vLLM's own method, called directly: per scheduled request, a super() lookup is a measurable share.
_vllm_allocate_slots = KVCacheManager.allocate_slots


def admission_bound(block_sizes: list[int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Most blocks one ``allocate_slots(request, *args, **kwargs)`` call can take from the pool."""
    tokens = sum(int(_argument(args, kwargs, name) or 0) for name in _TOKEN_ARGS)
    return sum(-(-tokens // size) + 2 for size in block_sizes)


def queued_hits(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Prefix-cache hits of one ``allocate_slots(request, *args, **kwargs)`` call that sit in the free
    queue (no request holds them): the call takes them out of the queue, so they cannot also be evicted
    for its new blocks. Counted as vLLM counts its evictable computed blocks."""
    hits = _argument(args, kwargs, "new_computed_blocks")
    if hits is None:
        return 0
    return sum(1 for group in hits.blocks for block in group if block.ref_cnt == 0 and not block.is_null)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The value of ``allocate_slots``'s parameter ``name`` in a call ``(request, *args, **kwargs)``, or None
    when the call did not pass it."""
    if name in kwargs:
        return kwargs[name]
    pos = _POSITIONS.get(name, len(args))
    return args[pos] if pos < len(args) else None


class ElasticKVCacheManager(KVCacheManager):
    """vLLM's ``KVCacheManager``; constructed by vLLM's scheduler (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        compat.check_instance(self, "vllm.v1.core.kv_cache_manager.KVCacheManager")
        compat.check_instance(self.coordinator, "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator")
        single_type = "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager"
        for manager in self.coordinator.single_type_managers:
            compat.check_instance(manager, single_type)
        self._block_sizes = [int(m.block_size) for m in self.coordinator.single_type_managers]
        pool = self.block_pool
        self._pool: ElasticBlockPool | None = pool if isinstance(pool, ElasticBlockPool) else None
        # Calls answered None (memory refused): the scheduler waits instead of spinning when a step
        # scheduled nothing for want of memory (vllm_elastic_kv.scheduler.fit.Stall).
        self.refusals = 0
        self.last_refused: Any = None  # the request of the last refusal

    def allocate_slots(
        self, request: Any, num_new_tokens: Any, *args: Any, num_lookahead_tokens: Any = None, **kwargs: Any
    ) -> Any:
        """vLLM's ``allocate_slots`` under the pool's admission (see the module docstring).

        ``num_lookahead_tokens`` is named so that the scheduler's per-request call,
        ``allocate_slots(request, n, num_lookahead_tokens=k)``, is passed on as it came, without building an
        argument dict; ``None`` means the caller did not pass it by name (vLLM's default applies)."""
        pool = self._pool
        if pool is None or pool.ledger is None:
            if num_lookahead_tokens is not None:
                kwargs["num_lookahead_tokens"] = num_lookahead_tokens
            return _vllm_allocate_slots(self, request, num_new_tokens, *args, **kwargs)
        if pool.backed_only and not args and not kwargs:
            # The running-request call, inside the scheduler's step, where the pool counts the blocks it
            # holds. A running request has no watermark and no reserved blocks, so vLLM admits it against
            # them exactly when the bound would have found them enough (it needs at most the bound).
            if num_lookahead_tokens is None:
                blocks = _vllm_allocate_slots(self, request, num_new_tokens)
            else:
                blocks = _vllm_allocate_slots(
                    self, request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens
                )
            if blocks is not None:
                return blocks
            tried_backed = True
        else:
            tried_backed = False
        if num_lookahead_tokens is not None:
            kwargs["num_lookahead_tokens"] = num_lookahead_tokens
        return self._admitted(pool, request, (num_new_tokens, *args), kwargs, tried_backed)

    def _admitted(
        self,
        pool: ElasticBlockPool,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tried_backed: bool,
    ) -> Any:
        """``allocate_slots`` when the backed free blocks may not cover the call (see the module docstring);
        ``tried_backed``: the call was already tried counting held blocks only, and vLLM said no."""
        ledger = pool.ledger
        assert ledger is not None
        bound = admission_bound(self._block_sizes, args, kwargs)
        if ledger.free_backed_blocks >= bound:
            blocks = _vllm_allocate_slots(self, request, *args, **kwargs)  # backed already: nothing to do
            if blocks is None:  # a waiting request behind vLLM's watermark, or with more than the bound
                self.refusals += 1
                self.last_refused = request
            return blocks
        if not tried_backed:
            # The bound overestimates (most decode calls need no block at all): first try with the held
            # blocks only; vLLM returns None before changing anything if they do not suffice, and
            # retrying allocate_slots after a None is what vLLM's own scheduler does between preemptions.
            with pool.counting(backed_only=True):
                blocks = _vllm_allocate_slots(self, request, *args, **kwargs)
            if blocks is not None:
                return blocks
        with pool.counting(backed_only=False), pool.admission(bound, queued_hits(args, kwargs)):
            blocks = _vllm_allocate_slots(self, request, *args, **kwargs)
        if blocks is None:
            self.refusals += 1
            self.last_refused = request
        return blocks
