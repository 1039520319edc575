"""Getting under a lowered limit within a bounded number of steps: SGLang retracts the requests that hold
slots on the pages being released.

When ``kvctl limit`` drops a pool's limit below what it holds, the ledger chooses pages to release -- its
*draining* pages (:meth:`elastic_kv.ledger.Ledger.draining_pages`) -- and issues no block on them from then
on. SGLang frees them through its own decode retraction (``ScheduleBatch.retract_decode``), steered here:

* :func:`drain_order` -- the ledger's order of preference among pages to drain -- follows SGLang's
  retraction order (``ScheduleBatch._get_decode_retraction_order``: the retraction loop pops requests
  from the end of that list), so that the pages chosen are the ones the requests SGLang retracts first
  hold, and as few requests as possible are retracted;
* the allocators' ``check_decode_capacity`` answers False while a request it is asked about holds slots
  on a draining page, other than the first of SGLang's retraction order (:func:`must_retract`), so the
  scheduler's next decode step retracts requests from the end of its order until none of those left
  does. That first request is never retracted for a drain (SGLang keeps at least one request and aborts
  a last one that does not fit): the pages it holds drain when it finishes, and requests admitted
  meanwhile are not retracted on its account. Cached prefix entries on draining pages are evicted while
  the pool is over its limit (the ``release_kv_cache`` and ``retract_decode`` hooks, the allocators'
  eviction), so a retracted request admitted again does not match its prefix there.

Retracted requests go back to SGLang's waiting queue and are recomputed once admission (which sees only
what the pool can back under its limit) lets them in again, so their greedy tokens are unchanged. A slot
freed on a draining page is not handed out again (the page_size 1 allocator withholds it; the paged one
returns pages to the ledger as SGLang frees them), and the page is unmapped once its epoch is released.

Which slots a request holds is read from SGLang's request-to-token table: ``[0, kv_allocated_len)`` of
its row, its own KV and the cached prefix it has locked (retracting it unlocks that prefix, which the
over-limit eviction then frees).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from elastic_kv.ledger.drain import order_by_holders

__all__ = [
    "RunningRequests",
    "drain_order",
    "holds_draining",
    "must_retract",
    "request_blocks",
    "retraction_order",
]

# What a scheduler is running now: its decode batch's requests and its request-to-token pool.
RunningRequests = Callable[[], tuple[Sequence[Any], Any]]


def request_blocks(
    req_to_token: Any,
    request: Any,
    rows_per_block: int,
    translate: Callable[[torch.Tensor], torch.Tensor] | None,
) -> list[int]:
    """The ledger blocks of the slots ``request`` references (its request-to-token row up to
    ``kv_allocated_len``), through ``translate`` when the pool's slots are not the table's (the SWA side
    of a hybrid); [] for a request that holds no row."""
    kv = request.kv
    if kv.req_pool_idx is None or kv.kv_allocated_len <= 0:
        return []
    slots = req_to_token.req_to_token[kv.req_pool_idx, : kv.kv_allocated_len]
    if translate is not None:
        slots = translate(slots)
    return torch.unique(slots.to(torch.int64) // rows_per_block).tolist()


def holds_draining(allocator: Any, requests: Iterable[Any], req_to_token: Any) -> bool:
    """Whether any of ``requests`` holds a slot on one of ``allocator``'s draining pages (an elastic
    allocator: :class:`~sglang_elastic_kv.allocators.ElasticAllocatorMixin`)."""
    ledger = allocator._ledger
    if not ledger.draining:
        return False
    rows = int(allocator._elastic_pool.rows_per_block)
    translate = allocator.elastic_translate
    return any(ledger.holds_draining(request_blocks(req_to_token, r, rows, translate)) for r in requests)


def must_retract(allocator: Any, requests: Sequence[Any], req_to_token: Any) -> bool:
    """Whether SGLang's retraction loop should go on for ``allocator``'s drain: a request of ``requests``
    holds a slot on a draining page, other than the one request the loop never retracts (the first of
    SGLang's retraction order). Retracting others would not vacate that one's pages: they drain when it
    finishes."""
    if len(requests) < 2 or not allocator._ledger.draining:
        return False
    kept = retraction_order(requests)[0]
    return holds_draining(allocator, (r for i, r in enumerate(requests) if i != kept), req_to_token)


def retraction_order(requests: Sequence[Any]) -> list[int]:
    """Indices of ``requests`` from the one SGLang keeps longest to the one it retracts first (SGLang's own
    ``ScheduleBatch._get_decode_retraction_order``: the scheduler's retraction policy)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return list(ScheduleBatch._get_decode_retraction_order(list(requests)))


def drain_order(allocator: Any, running: RunningRequests, candidates: list[int]) -> list[int]:
    """The ledger's ``drain_order`` for one elastic allocator: pages no running request holds first, then
    the pages that retracting running requests in SGLang's order (first retracted first) vacates
    (:func:`~elastic_kv.ledger.drain.order_by_holders`)."""
    requests, req_to_token = running()
    if not requests:
        return candidates
    bpp = allocator._ledger.geometry.blocks_per_page
    rows = int(allocator._elastic_pool.rows_per_block)
    translate = allocator.elastic_translate
    holdings = (
        {b // bpp for b in request_blocks(req_to_token, requests[i], rows, translate)}
        for i in reversed(retraction_order(requests))
    )
    return order_by_holders(candidates, holdings)
