"""Requests that cannot fit under a pool's ceiling, in SGLang: ended with an error instead of waiting forever,
and a scheduler that waits for memory without spinning.

A pool's *ceiling* is the tightest of its ``kvctl`` limit and its device's budget; the ledger counts the
blocks requests can hold under it (:attr:`elastic_kv.ledger.Ledger.max_request_blocks`). SGLang sizes its
requests against the logical pool, so under a ceiling a request can need more than the pool may ever back:

* a waiting request (new, or retracted) whose prompt and output so far need more blocks than that is
  deferred by admission (:class:`~sglang_elastic_kv.allocator.base.ElasticPrefillBudget`) at every pass, for
  good. An AFTER hook on ``Scheduler._poll_timeout_aborts`` -- where SGLang produces the aborts of requests
  that waited or ran too long, on the rank that broadcasts input -- adds an ``AbortReq`` for each such
  request, with a 503 and a message that says why; SGLang's own ``abort_request`` then drops it from the
  waiting queue and answers the client, on every rank. Each is logged in one line and counted in the pool's
  snapshot (``failed_requests``).
* a running request that grows past the ceiling is retracted by SGLang's decode retraction (back to the
  waiting queue, where the hook above ends it), or, when it is the last one running, aborted by SGLang itself
  ("Out of memory even after retracting all other requests").

What a request needs: the blocks of every token it has (``Req.seqlen``), in each elastic pool that holds a
request's whole sequence (``rows_per_block`` tokens a block); a sliding-window pool holds only its window,
and counts nothing here, so the need is a lower bound and no request is ended that could have fit.

While requests wait for memory that may still come (another pool holds the device's budget), SGLang's loop
finds no batch and calls ``on_idle``, which returns at once while requests wait: the loop spins, and the
idle housekeeping where the ledger follows ``kvctl`` and the budget (``verify_byte_accounting``) never runs.
An AFTER hook on ``Scheduler.on_idle`` then, with nothing in flight, sleeps the way SGLang sleeps when fully
idle (``maybe_sleep_on_idle``: a poll of its input sockets for up to a second, with ``--sleep-on-idle``;
without it SGLang polls busily when idle too, by design) and runs that housekeeping, so a raised limit
admits them. The largest waiting or running request's need is published with the pool's snapshot
(``largest_request_bytes``) so ``kvctl`` can refuse a limit or a budget below it.
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus
from typing import Any

from elastic_kv.sizes import format_bytes

__all__ = ["on_idle_after", "poll_aborts_after", "unfit_aborts"]

logger = logging.getLogger(__name__)

# Seconds between two refreshes of the largest request's need while no ceiling binds (the ledger publishes
# at most every publish_interval_s; this is the same order).
_OBSERVE_INTERVAL_S = 0.1
_observed_at: dict[int, float] = {}


def _parts(scheduler: Any) -> list[Any]:
    """The scheduler's elastic allocators that hold each request's whole sequence (none if not elastic)."""
    from sglang_elastic_kv.hooks import is_elastic_allocator

    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if allocator is None or not is_elastic_allocator(allocator):
        return []
    return [part for part in allocator.elastic_parts() if part.elastic_holds_sequence]


def _longest(part: Any, fresh: bool = False) -> int:
    """The most tokens one request may have in ``part``'s pool under its ceiling (``fresh``: as the records
    say now, see :meth:`elastic_kv.ledger.Ledger.max_request_blocks_now`)."""
    ledger = part._ledger
    blocks = ledger.max_request_blocks_now() if fresh else ledger.max_request_blocks
    return int(blocks) * int(part._elastic_pool.rows_per_block)


def _blocks(part: Any, tokens: int) -> int:
    rows = int(part._elastic_pool.rows_per_block)
    return -(-tokens // rows)


def unfit_aborts(scheduler: Any) -> list[Any]:
    """``AbortReq``s for the waiting requests of ``scheduler`` that need more than a pool's ceiling lets a
    request hold, each counted and logged; and, at most every 0.1 s or while a ceiling binds, the largest
    request's need noted in each pool (see the module docstring)."""
    parts = _parts(scheduler)
    if not parts:
        return []
    binding = [p for p in parts if p._ledger.max_request_blocks < p._ledger.geometry.num_blocks - 1]
    now = time.monotonic()
    if not binding and now - _observed_at.get(id(scheduler), float("-inf")) < _OBSERVE_INTERVAL_S:
        return []
    _observed_at[id(scheduler)] = now
    waiting = list(scheduler.waiting_queue)
    aborts: list[Any] = []
    if binding:
        longest = min(_longest(p) for p in binding)
        if any(req.seqlen > longest for req in waiting):
            # The ceiling follows kvctl from maintain(); a raise made since must end nothing.
            longest = min(_longest(p, fresh=True) for p in binding)
            aborts = [_abort(scheduler, req, binding) for req in waiting if req.seqlen > longest]
    running = [r for r in scheduler.running_batch.reqs if not r.finished()]
    ended = {a.rid for a in aborts}
    largest = max((r.seqlen for r in waiting + running if r.rid not in ended), default=0)
    for part in parts:
        part._ledger.note_largest_request(_blocks(part, largest))
    return aborts


def _abort(scheduler: Any, req: Any, binding: list[Any]) -> Any:
    from sglang.srt.managers.io_struct import AbortReq

    part = min(binding, key=lambda p: _longest(p, fresh=True))
    ledger = part._ledger
    longest = _longest(part, fresh=True)
    need = format_bytes(ledger.bytes_for_blocks(_blocks(part, req.seqlen)))
    room = f"at most {longest} tokens" if longest else "no request"
    message = (
        f"needs more KV cache than pool {ledger.snapshot().name} may hold: its {req.seqlen} tokens need at "
        f"least {need}, and under the pool's limit or its device's budget a request can hold {room}; raise "
        "the limit with kvctl"
    )
    logger.warning("request %s ended: %s", req.rid, message)
    ledger.note_failed()
    reason = {"type": "abort", "status_code": HTTPStatus.SERVICE_UNAVAILABLE, "message": message}
    return AbortReq(rid=req.rid, abort_message=message, finished_reason=reason)


def poll_aborts_after(result: list[Any] | None, scheduler: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """AFTER ``Scheduler._poll_timeout_aborts``: SGLang's timeout aborts, then :func:`unfit_aborts`."""
    return [*(result or []), *unfit_aborts(scheduler)]


def on_idle_after(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """After ``Scheduler.on_idle`` (from :func:`sglang_elastic_kv.hooks.on_idle_after`): while requests wait
    and nothing runs (they wait for memory), sleep as SGLang does when fully idle instead of polling again at
    once, then run the idle housekeeping SGLang skips while requests wait."""
    if not scheduler.waiting_queue or not _parts(scheduler):
        return
    if scheduler.is_fully_idle():
        return  # SGLang's own on_idle did its housekeeping and slept
    if not scheduler.is_fully_idle(ignore_waiting=True):
        return  # a batch runs or its results are pending
    scheduler.maybe_sleep_on_idle()
    # SGLang's on_idle skips its idle housekeeping while requests wait, and that is where the ledger follows
    # kvctl and the device's budget: without it a raised limit would never admit them. Nothing is in flight.
    for problem in scheduler.token_to_kv_pool_allocator.verify_byte_accounting():
        logger.error("elastic KV pool check while requests wait for memory: %s", problem)
