"""The elastic Mamba state pool (the state super-cell) against SGLang's real ``HybridReqToTokenPool``,
``MambaPool`` and ``MambaSlotAllocator``, in-process on the host backend (no engine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from elastic_kv.errors import ConfigError

pytestmark = pytest.mark.sglang

LAYERS = [0, 1, 2]
MAMBA_SLOTS = 64


@pytest.fixture
def env(plugin_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The plugin's unit-test environment (conftest ``plugin_env``)."""
    return plugin_env


def _cache_params() -> Any:
    """A GDN layer's state (Qwen3-Next shape at toy size): conv (256, 3), temporal (4, 32, 32), float32."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=128,
        n_groups=2,
        num_heads=4,
        head_dim=32,
        state_size=32,
        conv_kernel=4,
    )
    return Mamba2CacheParams(
        shape=shape, layers=LAYERS, dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32)
    )


def _kwargs(**over: Any) -> dict[str, Any]:
    """SGLang's constructor arguments of a hybrid request pool, as its configurator passes them."""
    kw: dict[str, Any] = {
        "size": 8,
        "mamba_size": MAMBA_SLOTS,
        "mamba_spec_state_size": 8,
        "max_context_len": 256,
        "device": "cpu",
        "enable_memory_saver": False,
        "cache_params": _cache_params(),
        "mamba_layer_ids": LAYERS,
        "enable_mamba_extra_buffer": False,
        "enable_overlap_schedule": False,
    }
    kw.update(over)
    return kw


@pytest.fixture
def hybrid(env: pytest.MonkeyPatch) -> Iterator[Any]:
    from sglang_elastic_kv.mamba import ElasticHybridReqToTokenPool

    pool = ElasticHybridReqToTokenPool(**_kwargs())
    yield pool
    pool.mamba_pool.elastic.close()


def _tensors(pool: Any) -> list[torch.Tensor]:
    cache = pool.mamba_pool.mamba_cache
    return [*cache.conv, cache.temporal]


def _mapped(pool: Any) -> int:
    return int(pool.mamba_pool.elastic.snapshot().mapped_bytes)


def _slot_backed(pool: Any, slot: int) -> bool:
    elastic = pool.mamba_pool.elastic
    return bool(elastic.ledger.page_state(elastic.geometry.page_of(slot)) == "used")


def _req(pool: Any) -> Any:
    """What ``HybridReqToTokenPool.alloc`` reads and writes of a request."""
    kv = SimpleNamespace(
        req_pool_idx=None, holds_kv=False, kv_allocated_len=0, holds_mamba=False, mamba_pool_idx=None,
        mamba_needs_clear=False, mamba_ping_pong_track_buffer=None,
    )  # fmt: skip
    return SimpleNamespace(kv=kv, rid="r")


def test_state_tensors_have_sglangs_shapes_strides_and_dtypes(hybrid: Any) -> None:
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    native = HybridReqToTokenPool(**_kwargs())
    for ours, theirs in zip(_tensors(hybrid), _tensors(native), strict=True):
        assert ours.shape == theirs.shape and ours.stride() == theirs.stride() and ours.dtype == theirs.dtype
    assert hybrid.mamba_pool.size == native.mamba_pool.size == MAMBA_SLOTS
    # A block is one slot in every layer of every state tensor (the super-cell).
    geometry = hybrid.mamba_pool.elastic.geometry
    cell = sum(t.dtype.itemsize * t[0, 0].numel() * t.shape[0] for t in _tensors(hybrid))
    assert geometry.block_bytes == cell and geometry.num_blocks == MAMBA_SLOTS + 1


def test_a_request_slot_is_backed_when_taken_and_unmapped_when_freed(hybrid: Any) -> None:
    idle = _mapped(hybrid)  # the dummy slot 0's page
    reqs = [_req(hybrid) for _ in range(8)]
    rows = hybrid.alloc(reqs)
    assert rows is not None
    slots = [int(r.kv.mamba_pool_idx) for r in reqs]
    assert 0 not in slots and len(set(slots)) == 8
    assert all(_slot_backed(hybrid, s) for s in slots)
    grown = _mapped(hybrid)
    assert grown > idle
    # SGLang's kernels write the state through its own views; it reads back (backed memory).
    for t in _tensors(hybrid):
        t[:, slots] = 1.5
    assert all(bool((t[:, slots] == 1.5).all()) for t in _tensors(hybrid))
    hybrid.mamba_pool.clear_slots(torch.tensor(slots))
    assert all(bool((t[:, slots] == 0).all()) for t in _tensors(hybrid))
    for req in reqs:
        hybrid.free_mamba_cache(req)
        hybrid.free_rows([req.kv.req_pool_idx])
    snap = hybrid.mamba_pool.elastic.snapshot()
    assert snap.used_blocks == 0 and snap.mapped_bytes == idle
    assert hybrid.mamba_allocator.available_size() == MAMBA_SLOTS


def test_copy_between_slots_for_prefix_cache_checkpoints(hybrid: Any) -> None:
    alloc = hybrid.mamba_allocator
    src, dst = alloc.alloc(1), alloc.alloc(1)
    assert src is not None and dst is not None
    for t in _tensors(hybrid):
        t[:, src] = 7.0
    hybrid.copy_mamba_state(src, dst)
    assert all(bool((t[:, dst] == 7.0).all()) for t in _tensors(hybrid))
    alloc.free(src)  # the radix cache evicting one state returns its slot
    assert hybrid.mamba_pool.elastic.ledger.used_blocks == 1
    alloc.free(dst)
    assert hybrid.mamba_pool.elastic.ledger.used_blocks == 0


def test_allocation_groups_return_what_they_did_not_hand_out(hybrid: Any) -> None:
    alloc = hybrid.mamba_allocator
    alloc.alloc_group_begin(6)  # SGLang pre-takes a slot for each waiting request
    taken = [alloc.alloc(1) for _ in range(2)]
    alloc.alloc_group_end()
    assert hybrid.mamba_pool.elastic.ledger.used_blocks == 2
    assert alloc.available_size() == MAMBA_SLOTS - 2
    alloc.free(torch.cat([t for t in taken if t is not None]))
    assert hybrid.mamba_pool.elastic.ledger.used_blocks == 0 and alloc.elastic_idle_check() == []


def test_ping_pong_tracking_slots_are_elastic_too(env: pytest.MonkeyPatch) -> None:
    from sglang_elastic_kv.mamba import ElasticHybridReqToTokenPool

    pool = ElasticHybridReqToTokenPool(**_kwargs(enable_mamba_extra_buffer=True))
    try:
        req = _req(pool)
        assert pool.alloc([req]) is not None
        held = pool.mamba_pool.elastic.ledger.used_blocks
        assert held == 1 + pool.mamba_initial_tracking_slots
        pool.free_mamba_cache(req)
        assert pool.mamba_pool.elastic.ledger.used_blocks == 0
    finally:
        pool.mamba_pool.elastic.close()


def test_slots_beyond_the_budget_fail_cleanly_and_the_pool_refuses_a_limit(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ELASTIC_KV_LIMIT`` does not apply to the state pool and its record refuses a ``kvctl`` limit
    (SGLang fails where it cannot get a state slot); the device budget still bounds what is backed:
    allocation beyond it fails with nothing taken."""
    from elastic_kv.registry import LimitNotFollowedError, Registry
    from sglang_elastic_kv.mamba import ElasticHybridReqToTokenPool

    env.setenv("ELASTIC_KV_LIMIT", str(1 << 20))
    pool = ElasticHybridReqToTokenPool(**_kwargs())
    alloc = pool.mamba_allocator
    ledger = pool.mamba_pool.elastic.ledger
    assert ledger.snapshot().limit_bytes == 0
    page_bytes = pool.mamba_pool.elastic.geometry.page_bytes
    registry = Registry(tmp_path)
    assert registry.pool("sglang-mamba").follows_limit is False
    with pytest.raises(LimitNotFollowedError, match="cannot follow a limit"):
        registry.set_limit("sglang-mamba", 3 * page_bytes)
    registry.set_budget(pool.mamba_pool.elastic.record.device, 3 * page_bytes)
    ledger.maintain()
    try:
        assert alloc.available_size() == MAMBA_SLOTS  # logical, for SGLang's idle leak check
        backable = alloc.schedulable_available_size()
        assert 0 < backable < MAMBA_SLOTS
        assert alloc.alloc(MAMBA_SLOTS) is None
        assert pool.mamba_pool.elastic.ledger.used_blocks == 0  # nothing taken
        first = alloc.alloc(backable)  # what can be backed is a promise (conservative, never optimistic)
        assert first is not None
        held = [first]
        while (more := alloc.alloc(1)) is not None:
            held.append(more)
        assert pool.mamba_pool.elastic.ledger.charged_bytes <= 3 * page_bytes
        assert alloc.schedulable_available_size() == 0
        assert alloc.available_size() == MAMBA_SLOTS - len(torch.cat(held))
        alloc.free(torch.cat(held))
        assert alloc.schedulable_available_size() >= backable
        assert alloc.elastic_idle_check() == []
    finally:
        pool.mamba_pool.elastic.close()


def test_idle_check_reports_a_slot_the_allocator_does_not_hold(hybrid: Any) -> None:
    hybrid.mamba_allocator.alloc(2)
    assert hybrid.mamba_allocator.elastic_idle_check() == []
    assert hybrid.mamba_pool.elastic.ledger.alloc(1) is not None  # behind the allocator's back
    problems = hybrid.mamba_allocator.elastic_idle_check()
    assert problems and "live slots" in problems[0]


def test_sleep_returns_every_free_slot_and_clear_returns_everything(hybrid: Any) -> None:
    alloc = hybrid.mamba_allocator
    idle = _mapped(hybrid)
    held = alloc.alloc(20)
    assert held is not None and _mapped(hybrid) > idle
    alloc.alloc_group_begin(10)
    alloc.alloc_group_end()
    alloc.free(held)
    alloc.elastic_sleep()
    assert _mapped(hybrid) == idle
    alloc.elastic_wake()
    assert alloc.alloc(5) is not None
    hybrid.clear()
    snap = hybrid.mamba_pool.elastic.snapshot()
    assert snap.used_blocks == 0 and snap.mapped_bytes == idle
    assert alloc.available_size() == MAMBA_SLOTS


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"speculative_num_draft_tokens": 4}, "speculative decoding"),
        ({"enable_linear_replayssm": True}, "--enable-linear-replayssm"),
        ({"mamba_envelope_layout": True}, "envelope layout"),
    ],
)
def test_state_layouts_the_pool_does_not_reproduce_are_refused(
    env: pytest.MonkeyPatch, over: dict[str, Any], reason: str
) -> None:
    from sglang_elastic_kv.mamba import ElasticHybridReqToTokenPool

    with pytest.raises(ConfigError, match=reason):
        ElasticHybridReqToTokenPool(**_kwargs(**over))


def test_the_hybrid_req_pool_builder_builds_the_elastic_pool_with_sglangs_arguments(
    env: pytest.MonkeyPatch,
) -> None:
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang_elastic_kv.hooks import build_hybrid_req_pool_around
    from sglang_elastic_kv.mamba import ElasticHybridReqToTokenPool

    def builder(configurator: Any) -> Any:  # what SGLang's builder does: the class named in its module
        return kv_cache_configurator.HybridReqToTokenPool(**_kwargs())

    gdn = SimpleNamespace(hybrid_gdn_config=object(), model_config=None)
    pool = build_hybrid_req_pool_around(builder, gdn)
    try:
        assert isinstance(pool, ElasticHybridReqToTokenPool)
        assert kv_cache_configurator.HybridReqToTokenPool is HybridReqToTokenPool  # restored
    finally:
        pool.mamba_pool.elastic.close()

    def native_builder(configurator: Any) -> Any:
        return HybridReqToTokenPool(**_kwargs())

    with pytest.raises(ConfigError, match="not the elastic request pool"):
        build_hybrid_req_pool_around(native_builder, gdn)


@pytest.mark.parametrize("arch", ["NemotronHForCausalLM", "FalconH1ForCausalLM", "KimiLinearForCausalLM"])
def test_state_hybrids_other_than_gdn_are_refused_by_name(arch: str) -> None:
    """Mamba2 and KDA hybrids have no engine proof (SGLang's CPU engine cannot run them): refused before any
    pool is built, in one line naming the architecture."""
    from sglang_elastic_kv.hooks import build_hybrid_req_pool_around

    def builder(configurator: Any) -> Any:
        raise AssertionError("no pool is built for a refused model")

    mamba2 = SimpleNamespace(
        hybrid_gdn_config=None, model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]))
    )
    with pytest.raises(ConfigError, match=rf"^--kv-cache-backend=elastic serves Gated DeltaNet .*; {arch} "):
        build_hybrid_req_pool_around(builder, mamba2)


def test_the_token_allocator_drives_the_state_pool(hybrid: Any) -> None:
    """Over a hybrid's ``HybridLinearKVPool`` the token allocator backs the elastic full-attention pool and
    drives the Mamba slot allocator's release epochs, idle checks and sleep (the configure hook attaches
    it); a native request pool under an elastic KV cache fails start-up."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator
    from sglang_elastic_kv.hooks import verify_configured_after
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    kv = HybridLinearKVPool(
        size=512, dtype=torch.float32, page_size=1, head_num=2, head_dim=32, full_attention_layer_ids=[3],
        device="cpu", mamba_pool=hybrid.mamba_pool, full_kv_pool_class=ElasticMHATokenToKVPool,
    )  # fmt: skip
    try:
        alloc = ElasticTokenToKVPoolAllocator(512, torch.float32, "cpu", kv, False)
        cfg = SimpleNamespace(_page_major_enabled=lambda: False, mambaish_config=object())
        verify_configured_after(
            SimpleNamespace(token_to_kv_pool_allocator=alloc, req_to_token_pool=hybrid), cfg
        )
        assert alloc.alloc(100) is not None
        slots = hybrid.mamba_allocator.alloc(3)
        assert slots is not None
        epoch = hybrid.mamba_pool.elastic.ledger.epoch
        alloc.free_group_begin()
        alloc.free_group_end()
        assert hybrid.mamba_pool.elastic.ledger.epoch == epoch + 1
        assert alloc.verify_byte_accounting() == []
        hybrid.mamba_pool.elastic.ledger.alloc(1)
        assert any("Mamba" in p for p in alloc.verify_byte_accounting())
        with pytest.raises(ConfigError, match="not the elastic request pool"):
            verify_configured_after(
                SimpleNamespace(
                    token_to_kv_pool_allocator=alloc, req_to_token_pool=HybridReqToTokenPool(**_kwargs())
                ),
                cfg,
            )
    finally:
        kv.full_kv_pool.elastic.close()


def test_admission_counts_the_state_slots_that_can_be_backed(hybrid: Any) -> None:
    """SGLang 0.5.23 gates new requests on state slots only in its unified Mamba pool, and a slot it cannot
    get at allocation or checkpoint is fatal there. The KV allocator's prefill budget counts them: as many
    new requests as state slots can be backed now or freed by evicting cached states, then none (so a
    tight device budget delays requests); a chunk of a running request takes no new slot."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool
    from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator
    from sglang_elastic_kv.hooks import verify_configured_after
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    kv = HybridLinearKVPool(
        size=512, dtype=torch.float32, page_size=1, head_num=2, head_dim=32, full_attention_layer_ids=[3],
        device="cpu", mamba_pool=hybrid.mamba_pool, full_kv_pool_class=ElasticMHATokenToKVPool,
    )  # fmt: skip

    class Cache:  # a Mamba radix cache holding one evictable state, no evictable KV
        def supports_mamba(self) -> bool:
            return True

        def full_evictable_size(self) -> int:
            return 0

        def mamba_evictable_size(self) -> int:
            return 1

    try:
        alloc = ElasticTokenToKVPoolAllocator(512, torch.float32, "cpu", kv, False)
        cfg = SimpleNamespace(_page_major_enabled=lambda: False, mambaish_config=object())
        verify_configured_after(
            SimpleNamespace(token_to_kv_pool_allocator=alloc, req_to_token_pool=hybrid), cfg
        )
        assert hybrid.mamba_allocator.elastic_slots_per_request == 1  # no tracking buffers here
        held = hybrid.mamba_allocator.alloc(MAMBA_SLOTS - 2)  # two free slots left
        assert held is not None
        budget = alloc.create_prefill_budget(Cache())
        ask = {
            "extend_input_len": 8,
            "total_tokens": 16,
            "max_new_tokens": 8,
            "input_tokens": 8,
            "swa_host_hit_length": 0,
            "chunk_limit": None,
        }
        # Two free slots and one cached state SGLang can evict: three slots; a request takes two (its state
        # and the copy the radix cache checkpoints once its prefill ends).
        assert budget._requests_room == 1
        assert budget.has_capacity() and budget.check_prefill(**ask)[0]
        budget.reserve(8, 8)
        assert budget.check_prefill(**ask) == (False, None) and not budget.has_capacity()
        assert not budget.can_allocate_prefill(
            paged_input=8, extend_input_len=8, max_new_tokens=8, chunk_limit=None
        )
        budget.reserve(8, 0, is_chunked_continuation=True)  # a running request's next chunk: no slot
        assert budget._requests_room == 0
        hybrid.mamba_allocator.free(held[:5])
        assert alloc.create_prefill_budget(Cache())._requests_room == (2 + 5 + 1) // 2
    finally:
        kv.full_kv_pool.elastic.close()
