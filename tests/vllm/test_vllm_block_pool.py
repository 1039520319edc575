"""The scheduler side without an engine: vLLM's own KV cache manager over the elastic block pool, the real
ledger and the real data plane (host backend, one SpaceGroup, LocalMapper).

vLLM's ``KVCacheManager`` is constructed exactly as the scheduler constructs it (the elastic classes bound
in for the duration), with real ``Request`` objects and prefix-cache hashing, so every path the engine
takes through ``allocate_slots`` / ``free`` / ``get_computed_blocks`` runs here in milliseconds.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import LocalMapper
from vllm_elastic_kv import compat
from vllm_elastic_kv.layout import planned_geometry
from vllm_elastic_kv.scheduler.block_pool import ElasticBlockPool
from vllm_elastic_kv.scheduler.kv_cache_manager import ElasticKVCacheManager, admission_bound, queued_hits
from vllm_elastic_kv.scheduler.scheduler_pool import StepEpochs

pytestmark = pytest.mark.vllm

BLOCK = 16  # tokens per block
NUM_BLOCKS = 64
LAYER_BLOCK_BYTES = BLOCK * 2 * 64 * 2 * 2  # tokens x kv heads x head size x (K, V) x fp16 = 8 KiB


@dataclasses.dataclass
class Stack:
    manager: ElasticKVCacheManager
    pool: ElasticBlockPool
    ledger: Ledger
    group: Any
    epochs: StepEpochs
    ids: Iterator[int]

    def request(self, tokens: list[int]) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        return Request(
            f"r{next(self.ids)}",
            tokens,
            SamplingParams(max_tokens=16),
            None,
            block_hasher=self.hasher,
        )

    hasher: Any = None
    pin: Any = None
    backend: Any = None  # _vmm.HostBackend, or a FaultInjectingBackend over one

    def backed(self, blocks: Any) -> bool:
        geo = self.ledger.geometry
        return all(self.group.is_mapped(geo.page_of(b.block_id)) for b in blocks)


def _kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    assert spec.page_size_bytes == LAYER_BLOCK_BYTES
    layers = ["l0", "l1"]
    tensor = KVCacheTensor(
        size=2 * NUM_BLOCKS * LAYER_BLOCK_BYTES,
        layers=layers,
        layer_stride=NUM_BLOCKS * LAYER_BLOCK_BYTES,
        block_stride=LAYER_BLOCK_BYTES,
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        kv_cache_layout="LBHNC",
        hash_block_size=BLOCK,
    )


def _stack(
    *,
    caching: bool = True,
    limit_pages: int = 0,
    defer_release: bool = False,
    reserve: tuple[int, int] = (0, 0),
    blocks_per_page: int = 2,
    events: bool = False,
    fault: bool = False,
) -> Stack:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    cfg = _kv_cache_config()
    page = blocks_per_page * LAYER_BLOCK_BYTES
    geo = planned_geometry(cfg, None, "one_buffer", page, max_page_slots=8)
    assert geo.blocks_per_page == blocks_per_page and geo.num_pages == -(-NUM_BLOCKS // blocks_per_page)
    backend = _vmm.FaultInjectingBackend(_vmm.HostBackend()) if fault else _vmm.HostBackend()
    space = _vmm.TensorSpace(backend, geo.space_sizes[0], page)
    group = _vmm.SpaceGroup([space], geo.extent_tuples(), geo.num_pages, _vmm.HandlePool(backend, 0))
    elastic = ElasticConfig(
        page_size=page,
        reserve_min_pages=reserve[0],
        reserve_max_pages=reserve[1],
        premap=False,
        defer_release=defer_release,
        limit_bytes=limit_pages * geo.page_bytes,
    )
    ledger = Ledger(geo, LocalMapper(group), elastic, null_block=0)
    with compat.scoped_attribute(
        compat.target("vllm.v1.core.kv_cache_coordinator", "BlockPool"), ElasticBlockPool
    ):
        manager = ElasticKVCacheManager(
            cfg,
            max_model_len=1024,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=caching,
            enable_kv_cache_events=events,
        )
    pool = manager.block_pool
    assert isinstance(pool, ElasticBlockPool)
    pool.attach(ledger)
    init_none_hash(sha256)
    stack = Stack(manager, pool, ledger, group, StepEpochs(ledger), itertools.count(), backend=backend)
    stack.hasher = get_request_block_hasher(BLOCK, sha256)
    # Block 1 shares the null block's page, which is never released: a long-running request holds it, so
    # that every page the tests look at holds only the blocks they allocate.
    stack.pin = stack.request([7, 7, 7])
    assert _allocate(stack, stack.pin) is not None
    stack.epochs.quiesce()  # nothing in flight: pages admission backed and gave back are released
    assert stack.group.num_mapped == 1
    return stack


def _allocate(stack: Stack, req: Any, computed: Any = None, num_computed: int = 0) -> Any:
    new_tokens = req.num_tokens - num_computed
    return stack.manager.allocate_slots(req, new_tokens, num_computed, computed)


def _finish(stack: Stack, req: Any) -> None:
    stack.manager.free(req)


def _blocks(stack: Stack, req: Any) -> list[Any]:
    return list(stack.manager.coordinator.single_type_managers[0].req_to_blocks[req.request_id])


def test_construction_keeps_vllms_classes_and_restores_the_names() -> None:
    import vllm.v1.core.kv_cache_coordinator as coordinator
    from vllm.v1.core.block_pool import BlockPool

    stack = _stack()
    assert coordinator.BlockPool is BlockPool
    assert isinstance(stack.pool, BlockPool) and stack.pool.null_block.block_id == 0
    assert stack.pool.num_cached == 0 and stack.ledger.used_blocks == 1  # the pinned block
    assert stack.group.is_mapped(0)  # the null block's page is always backed


def test_allocation_backs_pages_page_affinely() -> None:
    stack = _stack()
    req = stack.request(list(range(100, 100 + 3 * BLOCK + 5)))  # 4 blocks
    assert _allocate(stack, req) is not None
    got = _blocks(stack, req)
    assert len(got) == 4 and stack.backed(got)
    assert stack.group.num_mapped == 3  # null page + 4 blocks on 2 whole pages
    assert {b.block_id // 2 for b in got} == {b.block_id // 2 for b in got[:2]} | {got[3].block_id // 2}


def test_exhaustion_is_a_miss_with_nothing_changed() -> None:
    stack = _stack(limit_pages=3)  # the null page + 2 pages
    first = stack.request(list(range(200, 200 + 4 * BLOCK)))
    assert _allocate(stack, first) is not None
    state = (stack.ledger.used_blocks, stack.group.num_mapped, stack.pool.num_cached)
    big = stack.request(list(range(500, 500 + 6 * BLOCK)))
    assert _allocate(stack, big) is None  # vLLM's own check said no
    assert (stack.ledger.used_blocks, stack.group.num_mapped, stack.pool.num_cached) == state
    assert big.request_id not in stack.manager.coordinator.single_type_managers[0].req_to_blocks
    stack.pool.free_blocks([])  # no-op
    _finish(stack, first)
    assert _allocate(stack, big) is None  # 6 blocks > 4 under the limit, even with first's cached blocks
    small = stack.request(list(range(900, 900 + 2 * BLOCK)))
    assert _allocate(stack, small) is not None


def test_cached_blocks_count_as_free_and_are_reused_in_place_under_a_limit() -> None:
    stack = _stack(limit_pages=3)
    a = stack.request(list(range(300, 300 + 4 * BLOCK)))
    assert _allocate(stack, a) is not None
    _finish(stack, a)
    assert stack.pool.num_cached == 4  # full blocks keep their prefix-cache entries
    assert stack.ledger.used_blocks == 1 + 4  # ... and stay backed (1: the pinned block)
    assert stack.pool.get_num_free_blocks() >= 4
    mapped = stack.group.num_mapped
    b = stack.request(list(range(700, 700 + 4 * BLOCK)))  # no hit; the limit allows no new page
    assert _allocate(stack, b) is not None
    assert stack.group.num_mapped == mapped  # LRU cached blocks were evicted in place
    assert stack.pool.num_cached == 0
    assert stack.backed(_blocks(stack, b))


def test_prefix_hit_is_served_from_cached_blocks() -> None:
    stack = _stack()
    tokens = list(range(400, 400 + 3 * BLOCK))
    a = stack.request(tokens)
    _allocate(stack, a)
    _finish(stack, a)
    b = stack.request([*tokens, 1, 2, 3])
    computed, num_computed = stack.manager.get_computed_blocks(b)[:2]
    assert num_computed == 3 * BLOCK
    assert _allocate(stack, b, computed, num_computed) is not None
    assert stack.pool.num_cached == 0  # the hits were touched out of the queue


def test_prefix_hits_do_not_stand_in_for_the_same_calls_new_blocks() -> None:
    """A call takes its queued prefix hits out of the queue, so they cannot also be evicted for its new
    blocks: with the driver refusing pages, a call that needs new pages beyond its hits is a scheduler
    miss with nothing changed, and goes through once pages can be mapped again."""
    stack = _stack(fault=True)
    tokens = list(range(1000, 1000 + 8 * BLOCK))
    a = stack.request(tokens)
    assert _allocate(stack, a) is not None
    _finish(stack, a)
    stack.epochs.quiesce()
    assert stack.pool.num_cached == 8 and stack.ledger.free_backed_blocks == 0
    b = stack.request([*tokens, *range(5000, 5000 + 2 * BLOCK + 5)])  # 8 hits, then 3 new blocks
    computed, num_computed = stack.manager.get_computed_blocks(b)[:2]
    assert num_computed == 8 * BLOCK
    assert queued_hits((b.num_tokens - num_computed, num_computed, computed), {}) == 8
    assert queued_hits((), {"new_computed_blocks": computed}) == 8 and queued_hits((), {}) == 0
    stack.backend.fail("create", times=-1, error="oom")  # the driver is out of memory
    state = (stack.ledger.used_blocks, stack.group.num_mapped, stack.pool.num_cached)
    assert _allocate(stack, b, computed, num_computed) is None  # vLLM's check said no: preempt or wait
    assert (stack.ledger.used_blocks, stack.group.num_mapped, stack.pool.num_cached) == state
    assert b.request_id not in stack.manager.coordinator.single_type_managers[0].req_to_blocks
    assert all(block.ref_cnt == 0 for block in computed.blocks[0])
    stack.backend.clear()
    assert _allocate(stack, b, computed, num_computed) is not None
    got = _blocks(stack, b)
    assert len(got) == 11 and got[:8] == list(computed.blocks[0]) and stack.backed(got)


def test_trim_returns_only_pages_that_hold_nothing_else() -> None:
    stack = _stack()
    a = stack.request(list(range(1000, 1000 + 2 * BLOCK)))  # 2 blocks: one whole page
    _allocate(stack, a)
    b = stack.request(list(range(2000, 2000 + 3 * BLOCK)))  # 3 blocks: a page and half of another
    _allocate(stack, b)
    c = stack.request(list(range(3000, 3000 + BLOCK - 4)))  # 1 block, on b's half page (best fit)
    _allocate(stack, c)
    assert _blocks(stack, c)[0].block_id // 2 == _blocks(stack, b)[2].block_id // 2
    _finish(stack, a)
    _finish(stack, b)
    mapped = stack.group.num_mapped
    assert stack.pool.trim_cached() == 2  # a's page and b's whole page; not the page c shares
    assert stack.group.num_mapped == mapped - 2
    assert stack.pool.num_cached == 1


def _idle_with_cached_pages(stack: Stack) -> tuple[list[int], list[int]]:
    """Two finished requests, a (one page) then b (a page and half of another), and the pinned request
    finished too: no request holds a block, 5 blocks on 3 pages are cached. Returns their tokens."""
    a_tokens = list(range(1000, 1000 + 2 * BLOCK))
    b_tokens = list(range(2000, 2000 + 3 * BLOCK))
    for tokens in (a_tokens, b_tokens):
        req = stack.request(tokens)
        _allocate(stack, req)
        _finish(stack, req)
    _finish(stack, stack.pin)
    assert stack.pool.num_cached == 5 and stack.pool.num_referenced == 0
    assert stack.group.num_mapped == 4  # the null page and the 3 cached pages
    return a_tokens, b_tokens


def _hits(stack: Stack, tokens: list[int]) -> int:
    return int(stack.manager.get_computed_blocks(stack.request([*tokens, 1]))[1]) // BLOCK


def test_idle_trim_returns_every_cached_page_and_forgets_its_hashes() -> None:
    stack = _stack()
    a_tokens, b_tokens = _idle_with_cached_pages(stack)
    assert stack.pool.trim_cached() == 3
    assert stack.pool.num_cached == 0 and stack.ledger.used_blocks == 0
    assert stack.group.num_mapped == 1  # the null page only
    assert _hits(stack, a_tokens) == 0 and _hits(stack, b_tokens) == 0
    assert stack.pool.trim_cached() == 0  # nothing left


def _count_evictions(pool: ElasticBlockPool) -> list[int]:
    """Block ids that vLLM's per-block eviction sees from now on."""
    seen: list[int] = []
    evict = pool._maybe_evict_cached_block

    def counted(block: Any) -> bool:
        seen.append(block.block_id)
        return evict(block)

    pool._maybe_evict_cached_block = counted  # type: ignore[method-assign]
    return seen


def test_idle_trim_forgets_the_whole_cache_at_once() -> None:
    stack = _stack()
    a_tokens, b_tokens = _idle_with_cached_pages(stack)
    cached = [b for b in stack.pool.blocks if b.block_hash is not None]
    assert len(cached) == 5
    evicted = _count_evictions(stack.pool)
    assert stack.pool.trim_cached() == 3
    assert evicted == []  # no block-by-block eviction: the maps were replaced
    assert all(b.block_hash is None for b in cached)
    assert not stack.pool.cached_block_hashes_by_block
    assert _hits(stack, a_tokens) == 0 and _hits(stack, b_tokens) == 0
    # The cache works as before afterwards.
    again = stack.request(a_tokens)
    _allocate(stack, again)
    _finish(stack, again)
    assert _hits(stack, a_tokens) == 2


def test_idle_trim_with_kv_events_reports_every_evicted_block() -> None:
    from vllm.distributed.kv_events import BlockRemoved

    stack = _stack(events=True)
    a_tokens, b_tokens = _idle_with_cached_pages(stack)
    stack.pool.take_events()
    evicted = _count_evictions(stack.pool)
    assert stack.pool.trim_cached() == 3
    assert len(evicted) == 5  # vLLM's own eviction, one event per block
    removed = [h for e in stack.pool.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(removed) == 5
    assert _hits(stack, a_tokens) == 0 and _hits(stack, b_tokens) == 0


def test_trim_that_keeps_pages_evicts_block_by_block() -> None:
    stack = _stack()
    _idle_with_cached_pages(stack)
    evicted = _count_evictions(stack.pool)
    assert stack.pool.trim_cached(keep_pages=2) == 1
    assert len(evicted) == 2  # a's page; b's blocks keep their hashes
    assert sum(b.block_hash is not None for b in stack.pool.blocks) == 3


def test_idle_trim_keeps_the_most_recently_used_pages() -> None:
    stack = _stack()
    a_tokens, b_tokens = _idle_with_cached_pages(stack)
    assert stack.pool.trim_cached(keep_pages=2) == 1  # a's page, the least recently used
    assert stack.group.num_mapped == 3
    assert _hits(stack, a_tokens) == 0 and _hits(stack, b_tokens) == 3


def test_trim_tells_reuse_watchers_their_blocks_are_gone() -> None:
    from vllm.v1.core.block_pool import BlockPool

    if not hasattr(BlockPool, "unpin_blocks"):
        pytest.skip("this vLLM has no unpin_blocks (reuse watchers)")
    stack = _stack()
    a = stack.request(list(range(1000, 1000 + 2 * BLOCK)))
    _allocate(stack, a)
    blocks = _blocks(stack, a)
    stack.pool.touch(blocks)  # a reader's reference, released with unpin_blocks below
    _finish(stack, a)
    seen: list[int] = []
    stack.pool.unpin_blocks(blocks, lambda block: seen.append(block.block_id))
    _finish(stack, stack.pin)
    assert stack.pool.trim_cached() == 1
    assert sorted(seen) == sorted(b.block_id for b in blocks)


def test_reset_prefix_cache_waits_for_running_requests_then_returns_everything() -> None:
    stack = _stack()
    a = stack.request(list(range(10, 10 + 4 * BLOCK)))
    _allocate(stack, a)
    assert stack.manager.reset_prefix_cache() is False
    _finish(stack, a)
    assert stack.pool.num_cached == 4
    assert stack.manager.reset_prefix_cache() is False  # the pinned request still holds a block
    _finish(stack, stack.pin)
    assert stack.manager.reset_prefix_cache() is True
    assert stack.ledger.used_blocks == 0 and stack.pool.num_cached == 0
    assert stack.group.num_mapped == 1  # the null page only


def test_without_prefix_caching_blocks_go_straight_back() -> None:
    stack = _stack(caching=False)
    a = stack.request(list(range(10, 10 + 4 * BLOCK)))
    _allocate(stack, a)
    _finish(stack, a)
    assert stack.pool.num_cached == 0 and stack.ledger.used_blocks == 1
    assert stack.group.num_mapped == 1


def test_usage_counts_referenced_blocks_of_the_virtual_capacity() -> None:
    stack = _stack()
    a = stack.request(list(range(10, 10 + 4 * BLOCK)))
    _allocate(stack, a)
    assert stack.pool.get_usage() == pytest.approx(5 / (NUM_BLOCKS - 1))
    _finish(stack, a)
    assert stack.pool.get_usage() == pytest.approx(1 / (NUM_BLOCKS - 1))


def test_async_scheduling_barrier() -> None:
    """A page freed while a dispatched step may read it is unmapped only after that step's output."""
    stack = _stack(caching=False, defer_release=True)
    req = stack.request(list(range(10, 10 + 2 * BLOCK)))  # one whole page
    _allocate(stack, req)
    page = stack.ledger.geometry.page_of(_blocks(stack, req)[0].block_id)
    e1 = stack.epochs.step_dispatched()  # step 1 reads the request
    e2 = stack.epochs.step_dispatched()  # async: step 2 scheduled before step 1's output, still with it
    _finish(stack, req)  # step 1's output: the request finished
    stack.epochs.step_completed(e1)
    assert stack.group.is_mapped(page), "released while step 2 may still read it"
    assert not stack.epochs.quiesce()  # step 2 is in flight
    stack.epochs.step_completed(e2)
    assert not stack.group.is_mapped(page)


def test_sync_scheduling_releases_at_once() -> None:
    stack = _stack(caching=False, defer_release=True)
    req = stack.request(list(range(10, 10 + 2 * BLOCK)))
    _allocate(stack, req)
    page = stack.ledger.geometry.page_of(_blocks(stack, req)[0].block_id)
    e1 = stack.epochs.step_dispatched()
    _finish(stack, req)  # in update_from_output of step 1: nothing else is in flight
    assert stack.group.is_mapped(page)
    stack.epochs.step_completed(e1)
    assert not stack.group.is_mapped(page) and stack.group.num_mapped == 1


def test_admission_bound_reads_vllms_arguments() -> None:
    assert admission_bound([16], (32,), {}) == 2 + 2
    assert admission_bound([16], (1,), {"num_lookahead_tokens": 15}) == 1 + 2
    assert admission_bound([16, 32], (), {"num_new_tokens": 33, "num_external_computed_tokens": 0}) == 5 + 4


@pytest.mark.parametrize("limit_pages", [0, 2])
def test_running_request_inside_a_step_takes_backed_blocks_then_admission(limit_pages: int) -> None:
    """The scheduler counts backed blocks only while it schedules a step: a running request's decode call
    that needs no new page goes straight through; one that needs a page is admitted (maps it), or, when the
    limit allows none, is the scheduler's usual miss -- and the step's counting mode survives both."""
    stack = _stack(limit_pages=limit_pages)  # limit 2: the null page and the request's page
    req = stack.request(list(range(10, 10 + 2 * BLOCK - 1)))  # one page, one free slot in its last block
    assert _allocate(stack, req) is not None
    stack.epochs.quiesce()
    mapped = stack.group.num_mapped
    req.num_computed_tokens = req.num_tokens
    with stack.pool.counting(backed_only=True):  # what ElasticScheduler.schedule does around vLLM's
        req.append_output_token_ids(5)  # fits the last block: no new block, no mapping
        assert stack.manager.allocate_slots(req, 1, num_lookahead_tokens=0) is not None
        assert stack.group.num_mapped == mapped and stack.pool.backed_only
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(6)  # the next block starts a new page
        blocks = stack.manager.allocate_slots(req, 1, num_lookahead_tokens=0)
        assert stack.pool.backed_only
    if limit_pages:
        assert blocks is None and stack.group.num_mapped == mapped  # preempt or wait, as natively
    else:
        assert blocks is not None and stack.backed(_blocks(stack, req))
        assert stack.group.num_mapped == mapped + 1
    assert not stack.pool.backed_only and not stack.pool._stash


def test_scheduler_calls_a_rank_in_its_own_process_directly() -> None:
    from elastic_kv.ranks import InProcessTransport, Rank, SocketTransport
    from vllm_elastic_kv.scheduler.scheduler_pool import _transport
    from vllm_elastic_kv.worker import worker_pool

    rank = Rank(0)
    worker_pool.serve_locally("engine-a", rank)
    try:
        assert worker_pool.local_rank("engine-a", 0) is rank
        direct = _transport("engine-a", 1)
        assert isinstance(direct, InProcessTransport) and direct.world_size == 1
        # Another engine's rank, or ranks in other processes (TP > 1): sockets.
        for instance, world in (("engine-b", 1), ("engine-a", 2)):
            remote = _transport(instance, world)
            assert isinstance(remote, SocketTransport) and remote.world_size == world
            remote.close()
    finally:
        worker_pool.serve_locally("engine-a", None)
    assert worker_pool.local_rank("engine-a", 0) is None
    assert isinstance(_transport("engine-a", 1), SocketTransport)


def test_a_block_names_its_pool_directly_or_by_weak_reference() -> None:
    """0.29-0.33 keep the pool in ``KVCacheBlock.pool``; 0.34 keeps a weak reference to it."""
    import types
    import weakref

    from vllm_elastic_kv.scheduler.block_pool import owned_by

    class Pool:
        pass

    ours, other = Pool(), Pool()
    for field in (None, ours, weakref.ref(ours)):
        assert owned_by(types.SimpleNamespace(pool=field), ours)  # type: ignore[arg-type]
    for field in (other, weakref.ref(other)):
        assert not owned_by(types.SimpleNamespace(pool=field), ours)  # type: ignore[arg-type]
    assert owned_by(types.SimpleNamespace(), ours)  # type: ignore[arg-type]  # 0.26: no such field
