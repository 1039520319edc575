"""Getting under a lowered limit within a bounded number of steps: vacate the pages being released.

When ``kvctl limit`` drops a pool's limit below what it holds, the ledger chooses pages to release -- its
*draining* pages (:meth:`elastic_kv.ledger.Ledger.draining_pages`) -- and from then on issues no
block on them, so a block freed there is never handed to another request. It chooses them in the order
:func:`drain_order` gives: pages that only cached blocks hold, then the pages that preempting running
requests from the back of vLLM's running queue (vLLM's own preemption order) vacates, so that as few
requests as possible are preempted. What is left on them is freed here, at the start of the scheduler's
next ``schedule()``:

* every running request holding a block on a draining page is preempted the way vLLM preempts
  (``Scheduler._preempt_request``: its blocks are freed, it returns to the front of the waiting queue and
  is recomputed later, so its greedy tokens are those it would have produced anyway). As in vLLM's
  ``reset_prefix_cache(reset_running_requests=True)``, which also preempts outside a step, the request's
  in-flight output is dropped (:func:`_preempt`) and its tokens are sent again if it resumes in this same
  step -- which vLLM's own preemption never does;
* cached prefix blocks on draining pages that no request holds are evicted
  (:meth:`~vllm_elastic_kv.scheduler.block_pool.ElasticBlockPool.evict_draining`).

The pages then empty and are released once no step in flight can read them: at once with synchronous
scheduling, when the step in flight completes with asynchronous scheduling. So the pool is under its
limit two steps after the step that saw the limit (one to choose the pages, one to vacate them), whatever
the length of the running generations. Preempted requests resume as soon as the pages that stay backed
have room for them; they never get blocks on a draining page.

Requests that hold blocks while waiting (a KV connector's asynchronous loads) are not preempted; their
pages drain when they finish.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any

from elastic_kv.ledger.drain import order_by_holders
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_elastic_kv.scheduler.block_pool import owned_by

__all__ = ["drain_order", "vacate_draining_pages"]

logger = logging.getLogger(__name__)

# Releases with it (0.31+) drop a preempted request's in-flight output when told to.
_DROP_STALE = "drop_stale_output" in inspect.signature(Scheduler._preempt_request).parameters


def _block_ids(scheduler: Any, request: Any) -> list[int]:
    """The ids of the pool's blocks ``request`` holds, every KV cache group (the null block excluded)."""
    pool = scheduler.elastic_pool.block_pool
    groups = scheduler.kv_cache_manager.coordinator.get_blocks(request.request_id)
    return [
        block.block_id for group in groups for block in group if not block.is_null and owned_by(block, pool)
    ]


def _holds_draining(scheduler: Any, request: Any) -> bool:
    return bool(scheduler.elastic_pool.ledger.holds_draining(_block_ids(scheduler, request)))


def drain_order(scheduler: Any, candidates: list[int]) -> list[int]:
    """The ledger's ``drain_order`` for vLLM (:func:`~elastic_kv.ledger.drain.order_by_holders`): running
    requests taken from the last (the ones vLLM preempts first: least progress) to the first, so that
    draining the first pages of the order preempts as few requests as vLLM's own order allows."""
    bpp = scheduler.elastic_pool.ledger.geometry.blocks_per_page
    holdings = ({b // bpp for b in _block_ids(scheduler, request)} for request in reversed(scheduler.running))
    return order_by_holders(candidates, holdings)


def _preempt(scheduler: Any, request: Any, timestamp: float) -> None:
    """Preempt ``request`` (out of ``scheduler.running``) between steps, its in-flight output dropped.

    With asynchronous scheduling the request's last step may still be running; this ``schedule()`` call
    may resume it, recomputing the tokens that step produces, so that step's output must not be
    delivered too. Releases from 0.31 drop it when asked (``drop_stale_output``); 0.26 counts the frames
    to discard in ``async_tokens_to_discard``, as its own ``reset_prefix_cache(reset_running_requests=True)``
    does -- delivering them there gave the request more tokens than it had placeholders for, and the
    engine core died (``assert request.num_output_placeholders >= 0``)."""
    if _DROP_STALE:
        scheduler._preempt_request(request, timestamp, drop_stale_output=True)
    else:
        scheduler._preempt_request(request, timestamp)
        if hasattr(request, "async_tokens_to_discard"):
            request.async_tokens_to_discard = request.num_output_placeholders
            request.num_output_placeholders = 0
    # If it resumes in this step, Model Runner V1 needs its tokens again (it dropped its state); releases
    # with V2 only keep no such record (compat.PROBED).
    scheduled = getattr(scheduler, "prev_step_scheduled_req_ids", None)
    if scheduled is not None:
        scheduled.discard(request.request_id)


def vacate_draining_pages(scheduler: Any) -> int:
    """Preempt the running requests that hold blocks on draining pages and evict cached blocks there;
    release the emptied pages if no step is in flight. Returns the number of requests preempted.

    ``scheduler``: the elastic scheduler (vLLM's ``Scheduler`` with ``elastic_pool``), between steps, on its
    thread."""
    elastic = scheduler.elastic_pool
    holders = [request for request in scheduler.running if _holds_draining(scheduler, request)]
    if holders:
        timestamp = time.monotonic()
        # Preempted last to first: each goes to the front of the waiting queue, so they resume in order.
        for request in reversed(holders):
            scheduler.running.remove(request)
            _preempt(scheduler, request, timestamp)
        logger.info(
            "pool %s over its limit: preempted %d request(s) holding blocks on %d draining page(s)",
            elastic.record.name,
            len(holders),
            elastic.ledger.snapshot().draining_pages,
        )
    elastic.block_pool.evict_draining()
    elastic.epochs.quiesce()
    return len(holders)
