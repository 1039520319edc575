"""Getting under a lowered limit while requests run: SGLang retracts the requests that hold slots on the
pages being released.

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
  a last one that does not fit): the pages it holds drain when it finishes -- the one case where the limit
  waits for a request to end, since the drain prefers other pages -- and requests admitted
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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from elastic_kv.ledger.drain import order_by_holders

__all__ = [
    "RunningRequests",
    "drain_order",
    "draining_page_mask",
    "holds_draining",
    "must_retract",
    "request_blocks",
    "retraction_order",
]

# What a scheduler is running now: its decode batch's requests and its request-to-token pool.
RunningRequests = Callable[[], tuple[Sequence[Any], Any]]


def _slot_rows(
    req_to_token: Any, requests: Sequence[Any], translate: Callable[[torch.Tensor], torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The request-to-token rows of ``requests`` that hold slots, gathered at once (one device read for the
    batch, not one per request): (slots ``[n, width]`` in this pool's slot space, each row's length
    ``kv_allocated_len`` on the same device, the index in ``requests`` of each row)."""
    table = req_to_token.req_to_token
    held = [
        (i, r.kv.req_pool_idx, r.kv.kv_allocated_len)
        for i, r in enumerate(requests)
        if r.kv.req_pool_idx is not None and r.kv.kv_allocated_len > 0
    ]
    if not held:
        empty = torch.empty((0, 0), dtype=torch.int64, device=table.device)
        return empty, torch.empty((0,), dtype=torch.int64, device=table.device), []
    width = max(n for _, _, n in held)
    index = torch.tensor([row for _, row, _ in held], dtype=torch.int64, device=table.device)
    lengths = torch.tensor([n for _, _, n in held], dtype=torch.int64, device=table.device)
    within = torch.arange(width, device=table.device)[None, :] < lengths[:, None]
    # Past a row's length the table holds stale ids: read as slot 0 (the padding slot, on the null page).
    slots = torch.where(within, table[index, :width].to(torch.int64), 0)
    if translate is not None:
        slots = translate(slots).to(torch.int64)
    return slots, lengths, [i for i, _, _ in held]


def request_blocks(
    req_to_token: Any,
    requests: Sequence[Any],
    rows_per_block: int,
    translate: Callable[[torch.Tensor], torch.Tensor] | None,
) -> list[list[int]]:
    """For each of ``requests``, the ledger blocks of the slots it references (its request-to-token row up
    to ``kv_allocated_len``, through ``translate`` when the pool's slots are not the table's: the SWA side
    of a hybrid); [] for a request that holds no row."""
    out: list[list[int]] = [[] for _ in requests]
    slots, lengths, rows = _slot_rows(req_to_token, requests, translate)
    blocks = (slots // rows_per_block).cpu()
    for k, i in enumerate(rows):
        out[i] = torch.unique(blocks[k, : int(lengths[k])]).tolist()
    return out


def draining_page_mask(ledger: Any, device: Any) -> torch.Tensor | None:
    """A flag per page of ``ledger`` on ``device``, True where the page drains; None when none does. A
    slot's page is ``slot // (rows_per_block * blocks_per_page)``: the one mask the allocators' withholding
    and the retraction check index."""
    draining = ledger.draining_pages() if ledger.draining else []
    if not draining:
        return None
    mask = torch.zeros(ledger.geometry.num_pages, dtype=torch.bool, device=device)
    mask[torch.tensor(draining, dtype=torch.int64, device=device)] = True
    return mask


def holds_draining(allocator: Any, requests: Sequence[Any], req_to_token: Any) -> list[bool]:
    """For each of ``requests``, whether it holds a slot on one of ``allocator``'s draining pages (an
    elastic allocator: :class:`~sglang_elastic_kv.allocator.base.ElasticAllocatorMixin`). Computed on the
    table's device for the whole batch, with one small read back (a flag per request)."""
    ledger = allocator._ledger
    on_draining = draining_page_mask(ledger, req_to_token.req_to_token.device) if requests else None
    if on_draining is None:
        return [False] * len(requests)
    slots, _, rows = _slot_rows(req_to_token, requests, allocator.elastic_translate)
    per_page = int(allocator._elastic_pool.rows_per_block) * ledger.geometry.blocks_per_page
    hits = on_draining[slots // per_page].any(dim=1).tolist()  # slot 0's page (the null page) never drains
    out = [False] * len(requests)
    for i, hit in zip(rows, hits, strict=True):
        out[i] = bool(hit)
    return out


def must_retract(allocator: Any, requests: Sequence[Any], req_to_token: Any) -> bool:
    """Whether SGLang's retraction loop should go on for ``allocator``'s drain: a request of ``requests``
    holds a slot on a draining page, other than the one request the loop never retracts (the first of
    SGLang's retraction order). Retracting others would not vacate that one's pages: they drain when it
    finishes."""
    if len(requests) < 2 or not allocator._ledger.draining:
        return False
    kept = retraction_order(requests)[0]
    return any(hit for i, hit in enumerate(holds_draining(allocator, requests, req_to_token)) if i != kept)


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
    blocks = request_blocks(req_to_token, requests, rows, allocator.elastic_translate)
    holdings = ({b // bpp for b in blocks[i]} for i in reversed(retraction_order(requests)))
    return order_by_holders(candidates, holdings)
