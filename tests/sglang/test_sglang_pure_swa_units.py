"""The elastic all-sliding-window (pure SWA) allocator against SGLang's real ``SWAKVPool`` (no full-attention
layer) and ``PureSWATokenToKVPoolAllocator``, in-process on the host backend; and what sleep releases.
(No engine: ``device="cpu"`` SGLang objects, the real ledger and data plane.)"""

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
SWA_LAYERS = [0, 1, 2, 3]
SIZE_SWA = 2048
NAME = "pure-swa-unit"


def _pure_pool(pool_cls: Any = None) -> Any:
    """SGLang's SWAKVPool as its configurator builds it for an all-sliding model: the full side has no
    layers and no tokens."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    return SWAKVPool(
        0,
        SIZE_SWA,
        1,
        torch.float32,
        H,
        D,
        SWA_LAYERS,
        [],
        "cpu",
        token_to_kv_pool_class=pool_cls or ElasticMHATokenToKVPool,
        enable_memory_saver=False,
    )


@pytest.fixture
def pure(named_env: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    from sglang_elastic_kv.allocator.pure_swa import ElasticPureSWAAllocator

    pool = _pure_pool()
    alloc = ElasticPureSWAAllocator(SIZE_SWA, 1, torch.float32, "cpu", pool, False)
    yield pool, alloc
    pool.swa_kv_pool.elastic.close()


def test_the_empty_full_side_holds_nothing(pure: tuple[Any, Any], tmp_path: Path) -> None:
    pool, alloc = pure
    assert pool.full_kv_pool.no_layers and pool.full_kv_pool.elastic is None
    assert pool.full_kv_pool.k_buffer == [] and pool.full_kv_pool.v_buffer == []
    names = {info.name for info in Registry(tmp_path).pools()}
    assert names == {f"{NAME}-swa"}
    assert alloc.full_attn_allocator is alloc.swa_attn_allocator


def test_alloc_backs_slots_and_grouped_frees_return_them(pure: tuple[Any, Any]) -> None:
    pool, alloc = pure
    ledger = pool.swa_kv_pool.elastic.ledger
    slots = alloc.alloc(300)
    assert slots is not None and int(slots.min()) > 0
    assert ledger.used_blocks >= 300 // 64
    assert alloc.available_size() == SIZE_SWA - 300
    assert alloc.full_available_size() == alloc.swa_available_size() == SIZE_SWA - 300
    alloc.free_group_begin()
    alloc.free_swa(slots[:100])  # out-of-window frees while decoding
    alloc.free(slots[100:])
    assert ledger.used_blocks >= 300 // 64  # held until the group ends, as SGLang's own frees
    alloc.free_group_end()
    assert ledger.used_blocks == 0 and alloc.available_size() == SIZE_SWA
    assert alloc.verify_byte_accounting() == []


def test_capacity_hooks_follow_the_limit(pure: tuple[Any, Any], tmp_path: Path) -> None:
    pool, alloc = pure
    ledger = pool.swa_kv_pool.elastic.ledger
    page = pool.swa_kv_pool.elastic.geometry.page_bytes
    assert alloc.elastic_swa_available_size() == alloc.elastic_full_available_size() == SIZE_SWA
    Registry(tmp_path).set_limit(f"{NAME}-swa", 2 * page)
    ledger.maintain()
    room = alloc.elastic_swa_available_size()
    assert 0 < room < SIZE_SWA  # the limit, not the logical size
    assert alloc.check_decode_capacity(num_tokens=room, tree_cache=None)  # backs the step's slots now
    held = ledger.used_blocks
    assert held > 0
    assert not alloc.check_decode_capacity(num_tokens=room + 64, tree_cache=None)  # -> SGLang retracts
    assert alloc.alloc(room + 64) is None and ledger.used_blocks == held  # refused, nothing more taken
    assert alloc.alloc(room) is not None and ledger.used_blocks == held


def test_admission_budget_sees_the_one_pool(pure: tuple[Any, Any]) -> None:
    from sglang.srt.mem_cache.prefill_budget import SWAPrefillBudget
    from sglang_elastic_kv.allocator.swa import ElasticSWAPrefillBudget

    _, alloc = pure

    class NoCache:  # an engine without a prefix cache: nothing evictable
        def swa_evictable_size(self) -> int:
            return 0

        def full_evictable_size(self) -> int:
            return 0

        def supports_mamba(self) -> bool:
            return False

    budget = alloc.create_prefill_budget(NoCache())
    assert isinstance(budget, ElasticSWAPrefillBudget) and isinstance(budget, SWAPrefillBudget)
    assert budget.all_swa
    assert budget.remaining_total == SIZE_SWA == budget.remaining_swa
    alloc.alloc(500)
    assert alloc.create_prefill_budget(NoCache()).remaining_total == SIZE_SWA - 500


def test_sleep_unmaps_everything_but_the_null_page_and_releases_cached_handles(
    named_env: pytest.MonkeyPatch,
) -> None:
    from sglang_elastic_kv.allocator.pure_swa import ElasticPureSWAAllocator

    named_env.setenv("ELASTIC_KV_RESERVE_MIN", "2")
    named_env.setenv("ELASTIC_KV_RESERVE_MAX", "4")
    pool = _pure_pool()
    try:
        alloc = ElasticPureSWAAllocator(SIZE_SWA, 1, torch.float32, "cpu", pool, False)
        backing = pool.swa_kv_pool.elastic
        slots = alloc.alloc(1500)
        alloc.free(slots)
        alloc.clear()  # what SGLang's flush_cache does on release_memory_occupation
        backing.ledger.maintain()
        alloc.elastic_sleep()
        snap = backing.ledger.snapshot()
        assert snap.used_blocks == 0 and snap.reserve_pages == 0 and snap.mapped_pages == 1
        assert backing.handles.cached_bytes == 0  # unmapped pages hold no memory in the handle cache
        alloc.verify_byte_accounting()  # an idle pass while asleep maps no reserve again
        assert backing.ledger.snapshot().mapped_pages == 1
        alloc.elastic_wake()
        assert alloc.alloc(100) is not None
    finally:
        pool.swa_kv_pool.elastic.close()


def test_builder_swaps_sglangs_pure_allocator_and_checks_the_pool(pure: tuple[Any, Any]) -> None:
    from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_elastic_kv.allocator.pure_swa import ElasticPureSWAAllocator
    from sglang_elastic_kv.hooks import build_allocator_around, is_elastic_allocator

    pool, _ = pure
    built = build_allocator_around(
        lambda cfg, **kw: PureSWATokenToKVPoolAllocator(SIZE_SWA, 1, torch.float32, "cpu", pool, False),
        configurator(),
        token_to_kv_pool_allocator=None,
    )
    assert type(built) is ElasticPureSWAAllocator and is_elastic_allocator(built)
    assert built.get_kvcache() is pool and built.size_swa == SIZE_SWA
    native = _pure_pool(MHATokenToKVPool)
    with pytest.raises(ConfigError, match="elastic MHA sub-pool"):
        ElasticPureSWAAllocator(SIZE_SWA, 1, torch.float32, "cpu", native, False)
