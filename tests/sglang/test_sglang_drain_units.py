"""A lowered limit steers SGLang's decode retraction (``sglang_elastic_kv.drain``), in-process on SGLang's
real allocators and request-to-token table (no engine; the engine tests use ``generate_under_lowered_limit``).

Three running requests hold slots; the limit drops by one page. The ledger drains a page the request
SGLang retracts first holds alone; decode capacity is refused while a request SGLang's retraction can
reach holds slots there (never for the one it keeps longest); retracting that request empties the pages,
which are unmapped, and the pool is under its limit. Free slots on a draining page are never handed out.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.sglang

H, D, LAYERS = 2, 32, 2
SIZE = 8192


@pytest.fixture
def env(plugin_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The plugin's unit-test environment (conftest ``plugin_env``), 64-slot chunks at page_size 1."""
    plugin_env.setenv("ELASTIC_KV_SGLANG_TOKEN_CHUNK", "64")
    # SGLang's retraction order reads the scheduler's published settings; here: keep the last request
    # longest, retract the first first -- not the pages the ledger would pick alone (the most recently
    # mapped among the emptiest), so the engine's order is seen to decide.
    plugin_env.setattr("sglang_elastic_kv.drain.retraction_order", lambda reqs: list(range(len(reqs)))[::-1])
    return plugin_env


def _allocator(page_size: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: F401  (SGLang first)
    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator
    from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    pool = ElasticMHATokenToKVPool(SIZE, page_size, torch.float32, H, D, LAYERS, "cpu", False)
    if page_size == 1:
        return ElasticTokenToKVPoolAllocator(SIZE, torch.float32, "cpu", pool, False)
    return ElasticPagedTokenToKVPoolAllocator(SIZE, page_size, torch.float32, "cpu", pool, False)


class Batch:
    """Three running requests of ``tokens`` slots each, in SGLang's request-to-token table."""

    def __init__(self, alloc: Any, tokens: int) -> None:
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.table = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
        self.reqs: list[Any] = []
        self.slots: list[torch.Tensor] = []
        for i in range(3):
            slots = alloc.alloc(tokens)
            assert slots is not None
            self.table.write((i, slice(0, tokens)), slots.to(torch.int32))
            self.reqs.append(SimpleNamespace(kv=ReqKvInfo(req_pool_idx=i, kv_allocated_len=tokens)))
            self.slots.append(slots)
        alloc.elastic_follow(lambda: (self.reqs, self.table))

    def pages(self, alloc: Any, i: int) -> set[int]:
        geometry = alloc._elastic_pool.elastic.geometry
        return {geometry.page_of(int(s) // alloc._elastic_pool.rows_per_block) for s in self.slots[i]}


@pytest.fixture(params=[1, 16], ids=["ps1", "ps16"])
def running(env: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[tuple[Any, Batch]]:
    alloc = _allocator(request.param)
    batch = Batch(alloc, 768)  # three pages' worth of slots each at 256 slots a page
    yield alloc, batch
    alloc._elastic_pool.elastic.close()


def _lower_by_a_page(alloc: Any) -> int:
    ledger = alloc._ledger
    limit = ledger.charged_bytes - ledger.geometry.page_bytes
    ledger.resize(limit)
    alloc.elastic_step_end()
    return limit


def test_the_pages_drained_are_those_the_first_retracted_request_holds_alone(
    running: tuple[Any, Batch],
) -> None:
    alloc, batch = running
    _lower_by_a_page(alloc)
    draining = set(alloc._ledger.draining_pages())
    assert draining and draining <= batch.pages(alloc, 0) - batch.pages(alloc, 1) - batch.pages(alloc, 2)


def test_decode_capacity_is_refused_while_two_requests_hold_draining_slots(
    running: tuple[Any, Batch],
) -> None:
    alloc, batch = running
    reqs = batch.reqs
    assert alloc.check_decode_capacity(num_tokens=3, tree_cache=None, requests=reqs) is True
    _lower_by_a_page(alloc)
    assert alloc.check_decode_capacity(num_tokens=0, tree_cache=None, requests=reqs) is False
    # SGLang's retraction loop asks again about the requests it keeps: the last two hold no draining slot.
    assert alloc.check_decode_capacity(num_tokens=0, tree_cache=None, requests=reqs[1:]) is True
    # The last request is never retracted for a drain (SGLang would abort it): it finishes, then drains.
    assert alloc.check_decode_capacity(num_tokens=0, tree_cache=None, requests=reqs[:1]) is True
    # Nor the request SGLang keeps longest (here: the last listed), and a request admitted beside it is not
    # retracted on its account: retracting that one would vacate nothing.
    assert alloc.check_decode_capacity(num_tokens=0, tree_cache=None, requests=[reqs[1], reqs[0]]) is True
    assert alloc.check_decode_capacity(num_tokens=0, tree_cache=None, requests=[reqs[0], reqs[1]]) is False


def test_retracting_the_holder_releases_the_pages_and_meets_the_limit(running: tuple[Any, Batch]) -> None:
    alloc, batch = running
    ledger = alloc._ledger
    limit = _lower_by_a_page(alloc)
    assert ledger.over_limit()
    alloc.free(batch.slots[0])  # what retract_decode frees (release_req)
    alloc.elastic_step_end()  # the step's housekeeping: a page emptied in this epoch is released after it
    ledger.release_through(ledger.epoch)
    assert not ledger.over_limit() and ledger.charged_bytes <= limit
    assert not ledger.draining
    assert alloc.verify_byte_accounting() == []
    assert alloc.available_size() == SIZE - 2 * 768


def test_free_slots_on_a_draining_page_are_not_handed_out(env: pytest.MonkeyPatch) -> None:
    alloc = _allocator(1)
    try:
        batch = Batch(alloc, 768)
        _lower_by_a_page(alloc)
        draining = set(alloc._ledger.draining_pages())
        geometry = alloc._elastic_pool.elastic.geometry
        holder = batch.slots[0]
        on_draining = holder[torch.tensor([geometry.page_of(int(s) // 64) in draining for s in holder])]
        assert len(on_draining) >= 64
        # The holder frees some slots there (fewer than a chunk: its chunks stay in use), then a step ends.
        alloc.free(on_draining[:10])
        alloc.elastic_step_end()
        free_before = alloc.available_size()
        taken = alloc.alloc(64)  # SGLang hands out its lowest free slots first
        assert taken is not None and not (set(taken.tolist()) & set(on_draining.tolist()))
        assert alloc.available_size() == free_before - 64  # the logical face counts withheld slots as free
        alloc.free(taken)
        # The limit lifted: the withheld slots are in service again.
        alloc._ledger.resize(0)
        alloc.elastic_step_end()
        assert not alloc._ledger.draining
        assert alloc.verify_byte_accounting() == []
        rest = holder[~torch.isin(holder, on_draining[:10])]
        alloc.free(torch.cat([rest, *batch.slots[1:]]))
        assert alloc.available_size() == SIZE
        alloc._release_empty_chunks()
        assert alloc._ledger.used_blocks == 0
    finally:
        alloc._elastic_pool.elastic.close()


def test_the_scheduler_hook_makes_its_elastic_allocators_follow_the_running_batch(
    env: pytest.MonkeyPatch,
) -> None:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang_elastic_kv.hooks import follow_scheduler_after

    alloc = _allocator(16)
    try:
        table = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
        scheduler = SimpleNamespace(
            token_to_kv_pool_allocator=alloc,
            running_batch=SimpleNamespace(reqs=["r"]),
            req_to_token_pool=table,
            waiting_queue=[],
            tree_cache=None,
        )
        follow_scheduler_after(None, scheduler)
        assert alloc._running() == (["r"], table)
        scheduler.running_batch = SimpleNamespace(reqs=[])  # SGLang replaces its batch: followed
        assert alloc._running() == ([], table)
        assert alloc._ledger.drain_order is not None
        # Not elastic (native allocator): left alone.
        native = SimpleNamespace(token_to_kv_pool_allocator=object())
        follow_scheduler_after(None, native)
    finally:
        alloc._elastic_pool.elastic.close()


def test_a_decode_check_holds_through_the_free_group_before_the_allocation(env: pytest.MonkeyPatch) -> None:
    """SGLang's decode step is ``check_decode_capacity``, then ``alloc_for_decode``, which first runs
    ``maybe_evict_swa`` in a free group of its own; that group's end runs the pool's step housekeeping,
    which withholds free slots on draining pages. What the check admitted, the allocation must get (SGLang
    treats a failed decode allocation as fatal): the check counts only slots that stay in service and
    keeps what it backed until the allocation."""
    alloc = _allocator(1)
    try:
        batch = Batch(alloc, 768)
        _lower_by_a_page(alloc)
        assert alloc._ledger.over_limit()  # nothing more can be backed: only free backed slots count
        draining = set(alloc._ledger.draining_pages())
        geometry = alloc._elastic_pool.elastic.geometry
        holder = batch.slots[0]
        on_draining = holder[torch.tensor([geometry.page_of(int(s) // 64) in draining for s in holder])]
        alloc.free(on_draining[:10])  # in the free list until a step's housekeeping withholds them
        answers = {}
        for need in (alloc.elastic_available_size(), 1):  # all that looks free now, and one slot
            answers[need] = alloc.check_decode_capacity(num_tokens=need, tree_cache=None)
            alloc.free_group_begin()  # maybe_evict_swa, with nothing out of window to free
            alloc.free_group_end()
            if answers[need]:
                taken = alloc.alloc(need)
                assert taken is not None, f"the check admitted {need} slots, the allocation failed"
                assert not set(taken.tolist()) & set(on_draining.tolist())
                alloc.free(taken)
        assert answers[1] is True and False in answers.values()  # the free slots on the draining page
        assert alloc.verify_byte_accounting() == []
    finally:
        alloc._elastic_pool.elastic.close()
