"""Vacating the pages a lowered limit releases, without an engine: vLLM's KV cache manager over the
elastic block pool, the real ledger and data plane (the stack of ``test_vllm_block_pool``), and the few
scheduler attributes :mod:`vllm_elastic_kv.scheduler.drain` uses. The real scheduler's preemption runs in
``test_vllm_limit_drain``; here its stand-in frees the request's blocks as ``_preempt_request`` does.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from test_vllm_block_pool import BLOCK, Stack, _allocate, _blocks, _finish, _stack
from vllm_elastic_kv.scheduler.drain import drain_order, vacate_draining_pages

pytestmark = pytest.mark.vllm


class Scheduler:
    """What ``vacate_draining_pages`` and ``drain_order`` read of vLLM's scheduler."""

    def __init__(self, stack: Stack, running: list[Any]) -> None:
        self.running = list(running)
        self.kv_cache_manager = stack.manager
        self.elastic_pool = SimpleNamespace(
            ledger=stack.ledger, block_pool=stack.pool, epochs=stack.epochs, record=SimpleNamespace(name="t")
        )
        self.prev_step_scheduled_req_ids = {r.request_id for r in running}
        self.preempted: list[str] = []

    def _preempt_request(self, request: Any, timestamp: float, **kwargs: Any) -> None:
        self.kv_cache_manager.free(request)
        self.preempted.append(request.request_id)


def _pages(stack: Stack, req: Any) -> set[int]:
    geo = stack.ledger.geometry
    return {geo.page_of(b.block_id) for b in _blocks(stack, req)}


def _started(stack: Stack, first_token: int, blocks: int) -> Any:
    req = stack.request(list(range(first_token, first_token + blocks * BLOCK)))
    assert _allocate(stack, req) is not None
    return req


def test_the_fewest_requests_are_preempted_and_their_blocks_are_not_reissued() -> None:
    stack = _stack(defer_release=True)  # two blocks per page
    a, b, c = (_started(stack, 100 * (i + 1), blocks) for i, blocks in enumerate((4, 4, 2)))
    cached = _started(stack, 900, 2)
    _finish(stack, cached)  # its full blocks stay in the prefix cache: a page only cached blocks hold
    stack.epochs.quiesce()
    assert stack.pool.num_cached == 2
    page_bytes = stack.ledger.geometry.page_bytes
    assert stack.ledger.charged_bytes == 7 * page_bytes  # the null block's page, a 2, b 2, c 1, cached 1
    scheduler = Scheduler(stack, [a, b, c])
    stack.ledger.drain_order = functools.partial(drain_order, scheduler)

    stack.ledger.resize(5 * page_bytes)  # two pages must go
    geo = stack.ledger.geometry
    cached_page = {geo.page_of(block.block_id) for block in stack.pool.free_block_queue.get_all_free_blocks()}
    # The cached page costs no preemption; c, the last running request, vacates the second one.
    assert set(stack.ledger.draining_pages()) == cached_page | _pages(stack, c)
    assert vacate_draining_pages(scheduler) == 1  # type: ignore[arg-type]
    assert scheduler.preempted == [c.request_id] and scheduler.running == [a, b]
    assert c.request_id not in scheduler.prev_step_scheduled_req_ids  # its tokens are sent again
    # c's blocks and the cached ones were not kept (evicted, not queued) and their pages are released:
    # nothing was in flight, so at once.
    assert stack.pool.num_cached == 0
    assert stack.group.num_mapped == 5 and stack.ledger.charged_bytes == 5 * page_bytes
    assert not stack.ledger.over_limit() and stack.ledger.draining_pages() == []
    stack.ledger.check_invariants()
    assert vacate_draining_pages(scheduler) == 0  # type: ignore[arg-type]


def test_blocks_freed_on_a_draining_page_wait_for_the_step_in_flight() -> None:
    stack = _stack(defer_release=True)
    a, b = _started(stack, 100, 2), _started(stack, 200, 2)
    page_bytes = stack.ledger.geometry.page_bytes
    scheduler = Scheduler(stack, [a, b])
    stack.ledger.drain_order = functools.partial(drain_order, scheduler)
    stack.epochs.step_dispatched()  # a step that reads b's blocks is in flight
    stack.ledger.resize(2 * page_bytes)
    (page,) = _pages(stack, b)
    assert stack.ledger.draining_pages() == [page]
    assert vacate_draining_pages(scheduler) == 1  # type: ignore[arg-type]
    assert stack.ledger.page_state(page) == "withheld" and stack.group.is_mapped(page)  # still readable
    # Over the limit nothing new is mapped, and the withheld page's blocks are not offered.
    late = stack.request(list(range(300, 300 + 2 * BLOCK)))
    assert _allocate(stack, late) is None
    stack.epochs.step_completed(stack.epochs.dispatched)
    assert not stack.group.is_mapped(page) and not stack.ledger.over_limit()
    stack.ledger.check_invariants()
