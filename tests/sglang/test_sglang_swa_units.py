"""The elastic hybrid sliding-window (SWA) allocator against SGLang's real ``SWAKVPool`` and
``SWATokenToKVPoolAllocator``, in-process, on the host backend (no engine: ``device="cpu"`` SGLang objects,
the real ledgers and data plane). The pool has three sliding-window layers and one full-attention layer,
as the tiny Laguna of :mod:`tests.support.sglang_models` does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from elastic_kv.errors import ConfigError
from elastic_kv.registry import Registry

from tests.support.sglang_units import configurator

pytestmark = pytest.mark.sglang


H, D = 2, 32
SWA_LAYERS, FULL_LAYERS = [0, 1, 2], [3]
SIZE, SIZE_SWA = 4096, 2048
NAME = "swa-unit"


def _swa_pool(page_size: int, pool_cls: Any = None, **kwargs: Any) -> Any:
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    return SWAKVPool(
        SIZE,
        SIZE_SWA,
        page_size,
        torch.float32,
        H,
        D,
        SWA_LAYERS,
        FULL_LAYERS,
        "cpu",
        token_to_kv_pool_class=pool_cls or ElasticMHATokenToKVPool,
        enable_memory_saver=False,
        **kwargs,
    )


def _close(pool: Any) -> None:
    for part in (pool.full_kv_pool, pool.swa_kv_pool):
        if getattr(part, "elastic", None) is not None:
            part.elastic.close()


def _make(page_size: int) -> tuple[Any, Any]:
    from sglang_elastic_kv.allocator.swa import ElasticSWATokenToKVPoolAllocator

    pool = _swa_pool(page_size)
    return pool, ElasticSWATokenToKVPoolAllocator(
        SIZE, SIZE_SWA, page_size, torch.float32, "cpu", pool, False
    )


@pytest.fixture(params=[1, 16], ids=["ps1", "ps16"])
def swa(named_env: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    pool, alloc = _make(request.param)
    yield pool, alloc
    _close(pool)


def _ledgers(pool: Any) -> tuple[Any, Any]:
    return pool.full_kv_pool.elastic.ledger, pool.swa_kv_pool.elastic.ledger


def _backed(sub_pool: Any, slots: torch.Tensor) -> bool:
    """Whether every page holding one of ``slots`` of ``sub_pool`` is mapped (K and V of every layer)."""
    ledger = sub_pool.elastic.ledger
    blocks = {int(s) // sub_pool.rows_per_block for s in slots}
    return all(ledger.page_state(sub_pool.elastic.geometry.page_of(b)) == "used" for b in blocks)


def _alloc(alloc: Any, lens: list[int]) -> torch.Tensor | None:
    """A prefill of fresh requests of ``lens`` tokens, the way the scheduler asks at this page size."""
    if alloc.page_size == 1:
        result: torch.Tensor | None = alloc.alloc(sum(lens))
        return result
    seq = torch.tensor(lens)
    prefix = torch.zeros_like(seq)
    last = torch.full_like(seq, -1)
    result = alloc.alloc_extend(prefix, prefix, seq, seq, last, sum(lens))
    return result


# -- pools and sizes --------------------------------------------------------------------------------------


def test_both_sub_pools_are_elastic_and_registered(swa: tuple[Any, Any], tmp_path: Path) -> None:
    from sglang_elastic_kv.allocator.base import ElasticAllocatorMixin

    pool, alloc = swa
    for sub, sub_pool in (
        (alloc.full_attn_allocator, pool.full_kv_pool),
        (alloc.swa_attn_allocator, pool.swa_kv_pool),
    ):
        assert sub.get_kvcache() is sub_pool
        assert isinstance(sub, ElasticAllocatorMixin)
    registry = Registry(tmp_path)  # the named_env fixture's registry directory
    full, swa_rec = registry.pool(f"{NAME}-full"), registry.pool(f"{NAME}-swa")
    assert full.engine == swa_rec.engine == "sglang"
    assert "mha-1l" in full.model and "mha-3l" in swa_rec.model
    # Nothing but the null page is backed before the first allocation, on either side.
    for ledger in _ledgers(pool):
        snap = ledger.snapshot()
        assert snap.used_blocks == 0 and snap.mapped_pages == 1


def test_available_sizes_stay_logical_elastic_sizes_are_physical(swa: tuple[Any, Any]) -> None:
    pool, alloc = swa
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (SIZE, SIZE_SWA)
    assert alloc.available_size() == SIZE_SWA
    assert (alloc.elastic_full_available_size(), alloc.elastic_swa_available_size()) == (SIZE, SIZE_SWA)
    swa_ledger = pool.swa_kv_pool.elastic.ledger
    # Limit the SWA side to two data-plane pages: the logical sizes (SGLang's idle leak check balances
    # them against the pool sizes) do not move; what the scheduler's hooks see does.
    swa_ledger.resize(2 * swa_ledger.geometry.page_bytes)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (SIZE, SIZE_SWA)
    room = alloc.elastic_swa_available_size()
    assert 0 < room < SIZE_SWA and alloc.elastic_full_available_size() == SIZE
    budget = alloc.create_prefill_budget(_NoCache())
    assert budget.remaining_swa == room
    assert budget.remaining_total == SIZE
    assert alloc.check_decode_capacity(num_tokens=room, tree_cache=None) is True
    assert alloc.check_decode_capacity(num_tokens=room + alloc.page_size, tree_cache=None) is False


class _NoCache:
    """A tree cache holding nothing (what the budget asks of SGLang's radix caches)."""

    sliding_window_size = 32

    def full_evictable_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return 0


# -- allocation -------------------------------------------------------------------------------------------


def test_allocation_backs_both_sides(swa: tuple[Any, Any]) -> None:
    pool, alloc = swa
    out = _alloc(alloc, [40, 100])
    assert out is not None and len(out) == 140 and 0 not in out.tolist()
    swa_slots = alloc.translate_loc_from_full_to_swa(out)
    assert bool((swa_slots > 0).all()) and len(set(swa_slots.tolist())) == 140
    assert _backed(pool.full_kv_pool, out) and _backed(pool.swa_kv_pool, swa_slots)
    assert alloc.full_available_size() == SIZE - 140 - (alloc.page_size > 1) * (160 - 140)
    if alloc.page_size > 1:
        # A decode step that opens a new page on both sides for the second request (seq 100 -> 101).
        last = torch.tensor([int(out[39]), int(out[139])])
        seq = torch.tensor([41, 101])
        dec = alloc.alloc_decode(seq, seq, last)
        assert dec is not None and int(dec[0]) == int(out[39]) + 1
        swa_dec = alloc.translate_loc_from_full_to_swa(dec)
        assert _backed(pool.full_kv_pool, dec) and _backed(pool.swa_kv_pool, swa_dec)
    assert alloc.verify_byte_accounting() == []


@pytest.mark.parametrize("short_side", ["swa", "full"])
def test_a_side_that_cannot_back_leaves_nothing_taken_on_the_other(
    swa: tuple[Any, Any], short_side: str
) -> None:
    pool, alloc = swa
    full_ledger, swa_ledger = _ledgers(pool)
    short = swa_ledger if short_side == "swa" else full_ledger
    short.resize(short.geometry.page_bytes)  # the null page only: this side cannot back one more block
    before = [(ledger.used_blocks, ledger.snapshot().mapped_pages) for ledger in (full_ledger, swa_ledger)]
    # More than the blocks that share the null page (backed for the pool's lifetime) can hold.
    assert _alloc(alloc, [600]) is None
    assert [(ledger.used_blocks, ledger.snapshot().mapped_pages) for ledger in _ledgers(pool)] == before
    if alloc.page_size > 1:
        # A decode step in which 40 requests each start a page: more than the null page's blocks.
        seq = torch.full((40,), 17)
        assert alloc.alloc_decode(seq, seq, torch.full((40,), -1)) is None
        assert [(ledger.used_blocks, ledger.snapshot().mapped_pages) for ledger in _ledgers(pool)] == before
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (SIZE, SIZE_SWA)
    assert alloc.verify_byte_accounting() == []
    # Lifting the limit makes the same allocation succeed on both sides.
    short.resize(0)
    assert _alloc(alloc, [600]) is not None


# -- frees, free groups, epochs, clear --------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_free_group_returns_both_sides_after_the_next_step(
    named_env: pytest.MonkeyPatch, page_size: int
) -> None:
    """Release epochs as on a GPU (``defer_release``, the default there): the SWA side gets its step
    housekeeping from the composite's free groups, though SGLang opens no group on it."""
    named_env.setenv("ELASTIC_KV_DEFER_RELEASE", "1")
    pool, alloc = _make(page_size)
    try:
        _free_group_steps(pool, alloc)
    finally:
        _close(pool)


def _free_group_steps(pool: Any, alloc: Any) -> None:
    full_ledger, swa_ledger = _ledgers(pool)
    out = _alloc(alloc, [300])
    assert out is not None
    epochs = (full_ledger.epoch, swa_ledger.epoch)
    alloc.free_group_begin()
    alloc.free(out)
    # Inside the group nothing is freed yet (SGLang holds the frees until the group ends).
    assert full_ledger.used_blocks > 0 and swa_ledger.used_blocks > 0
    alloc.free_group_end()
    # Both sides started a release epoch.
    assert (full_ledger.epoch, swa_ledger.epoch) == (epochs[0] + 1, epochs[1] + 1)
    assert full_ledger.used_blocks == 0 and swa_ledger.used_blocks == 0
    # The step launched before this group may still read the emptied pages: they wait one step.
    assert swa_ledger.snapshot().pending_pages > 0 and full_ledger.snapshot().pending_pages > 0
    alloc.free_group_begin()
    alloc.free_group_end()
    for ledger in (full_ledger, swa_ledger):
        snap = ledger.snapshot()
        assert snap.pending_pages == 0 and snap.mapped_pages == 1, snap
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (SIZE, SIZE_SWA)
    assert alloc.verify_byte_accounting() == []


def test_out_of_window_swa_frees_return_swa_memory_only(swa: tuple[Any, Any]) -> None:
    """What ``ScheduleBatch.maybe_evict_swa`` does while a long request decodes: free the SWA peers of the
    tokens that left the window; their full-attention slots stay."""
    pool, alloc = swa
    full_ledger, swa_ledger = _ledgers(pool)
    out = _alloc(alloc, [512])
    assert out is not None
    full_used, swa_used = full_ledger.used_blocks, swa_ledger.used_blocks
    alloc.free_swa(out[:448])  # page-aligned at both page sizes, as SGLang's eviction is
    assert full_ledger.used_blocks == full_used
    assert swa_ledger.used_blocks < swa_used
    assert alloc.swa_available_size() == SIZE_SWA - 64 and alloc.full_available_size() == SIZE - 512
    assert bool((alloc.translate_loc_from_full_to_swa(out[:448]) == 0).all())
    assert alloc.verify_byte_accounting() == []
    alloc.free_swa(out[448:])
    alloc.free_full(out)
    assert full_ledger.used_blocks == 0 and swa_ledger.used_blocks == 0
    assert alloc.verify_byte_accounting() == []


def test_clear_returns_both_sides(swa: tuple[Any, Any]) -> None:
    pool, alloc = swa
    assert _alloc(alloc, [700, 300]) is not None
    assert all(ledger.snapshot().mapped_pages > 1 for ledger in _ledgers(pool))
    alloc.clear()
    for ledger in _ledgers(pool):
        snap = ledger.snapshot()
        assert snap.used_blocks == 0 and snap.mapped_pages == 1, snap
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (SIZE, SIZE_SWA)


def test_verify_byte_accounting_names_the_side(swa: tuple[Any, Any]) -> None:
    pool, alloc = swa
    assert _alloc(alloc, [100]) is not None
    extra = pool.swa_kv_pool.elastic.ledger.alloc(1)  # a block the SWA allocator does not know about
    assert extra is not None
    violations = alloc.verify_byte_accounting()
    assert len(violations) == 1 and violations[0].startswith("swa: ")


def test_sleep_unmaps_both_reserves(swa: tuple[Any, Any], named_env: pytest.MonkeyPatch) -> None:
    pool, alloc = swa
    assert _alloc(alloc, [300]) is not None
    alloc.clear()  # release_memory_occupation flushes the cache first
    alloc.elastic_sleep()
    for ledger in _ledgers(pool):
        snap = ledger.snapshot()
        assert snap.reserve_pages == 0 and snap.mapped_pages == 1
    alloc.elastic_wake()
    assert _alloc(alloc, [10]) is not None


# -- what is built, what is refused ------------------------------------------------------------------------


def test_builder_hook_makes_sglangs_swa_allocator_elastic(named_env: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang_elastic_kv.allocator.swa import ElasticSWATokenToKVPoolAllocator
    from sglang_elastic_kv.hooks import build_allocator_around, verify_configured_after

    pool = _swa_pool(1)
    try:
        built = build_allocator_around(
            lambda cfg, **kw: SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, 1, torch.float32, "cpu", pool, False),
            configurator(),
            token_to_kv_pool_allocator=None,
        )
        assert type(built) is ElasticSWATokenToKVPoolAllocator and built.get_kvcache() is pool
        assert (built.size_full, built.size_swa) == (SIZE, SIZE_SWA)
        # The pool reads SGLang's slot table from the allocator now in charge.
        assert pool.full_to_swa_index_mapping is built.full_to_swa_index_mapping
        from types import SimpleNamespace

        verify_configured_after(
            SimpleNamespace(token_to_kv_pool_allocator=built),
            SimpleNamespace(_page_major_enabled=lambda: False, mambaish_config=None),
        )
    finally:
        _close(pool)


def test_non_elastic_or_mla_sub_pools_are_refused(named_env: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_elastic_kv.allocator.swa import ElasticSWATokenToKVPoolAllocator
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool, ElasticMLATokenToKVPool

    plain = _swa_pool(1, pool_cls=MHATokenToKVPool)
    with pytest.raises(ConfigError, match="full_kv_pool is MHATokenToKVPool"):
        ElasticSWATokenToKVPoolAllocator(SIZE, SIZE_SWA, 1, torch.float32, "cpu", plain, False)
    mla_kwargs = {"page_size": 1, "kv_lora_rank": 64, "qk_rope_head_dim": 32, "device": "cpu"}
    mixed = _swa_pool(
        1,
        pool_cls=ElasticMHATokenToKVPool,
        full_kv_pool_class=ElasticMLATokenToKVPool,
        full_kv_pool_kwargs={**mla_kwargs, "enable_memory_saver": False},
    )
    try:
        with pytest.raises(ConfigError, match="full_kv_pool is ElasticMLATokenToKVPool"):
            ElasticSWATokenToKVPoolAllocator(SIZE, SIZE_SWA, 1, torch.float32, "cpu", mixed, False)
    finally:
        _close(mixed)


def test_a_drain_of_the_sliding_window_side_reaches_the_requests_through_the_slot_map(
    swa: tuple[Any, Any], named_env: pytest.MonkeyPatch
) -> None:
    """The request-to-token table holds full-attention slots; a drain of the sliding-window pool finds the
    requests holding its draining pages through SGLang's full-to-SWA slot map (``sglang_elastic_kv.drain``),
    and decode capacity is refused until SGLang's retraction reaches them."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ReqKvInfo
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang_elastic_kv.hooks import follow_scheduler_after

    # SGLang's retraction order (published settings in a scheduler): the first request is retracted first.
    named_env.setattr("sglang_elastic_kv.drain.retraction_order", lambda reqs: list(range(len(reqs)))[::-1])
    pool, alloc = swa
    # A long request whose tokens all left the window keeps 512 full-attention slots and no SWA slot, so
    # the requests below get full and SWA slots that differ (the map is not the identity).
    long = _alloc(alloc, [512])
    assert long is not None
    alloc.free_swa(long)
    table = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
    reqs = []
    for i in range(3):
        slots = _alloc(alloc, [512])  # two SWA pages' worth each
        assert slots is not None
        table.write((i, slice(0, 512)), slots.to(torch.int32))
        reqs.append(SimpleNamespace(kv=ReqKvInfo(req_pool_idx=i, kv_allocated_len=512)))
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=alloc,
        running_batch=SimpleNamespace(reqs=reqs),
        req_to_token_pool=table,
        waiting_queue=[],
        tree_cache=None,
    )
    follow_scheduler_after(None, scheduler)
    full_ledger, swa_ledger = _ledgers(pool)
    assert alloc.check_decode_capacity(num_tokens=0, tree_cache=None, requests=reqs) is True
    swa_ledger.resize(swa_ledger.charged_bytes - swa_ledger.geometry.page_bytes)
    alloc.free_group_begin()
    alloc.free_group_end()  # a step's housekeeping: the SWA side's ledger sees its limit and drains
    assert swa_ledger.draining and not full_ledger.draining
    assert alloc.check_decode_capacity(num_tokens=0, tree_cache=None, requests=reqs) is False
    assert alloc.check_decode_capacity(num_tokens=0, tree_cache=None, requests=reqs[1:]) is True
