"""The elastic SGLang pool and allocators on a CUDA device (marker ``gpu``; run where SGLang and a GPU
with VMM are both installed -- the project's GPU machine has no SGLang, see the report).

What only a GPU shows: the pool's buffers are CUDA tensors over ``CudaBackend`` spaces, SGLang's own
``set_kv_buffer`` writes through them, K and V of an allocated page are both backed, and ``defer_release``
keeps an emptied page mapped until its epoch is released."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from elastic_kv.ledger import Ledger

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]
sglang = pytest.importorskip("sglang")

H, D, LAYERS = 8, 128, 4


def _assert_frees_wait_a_step(
    ledger: Ledger, begin: Callable[[], None], end: Callable[[], None], free: Callable[[], None]
) -> None:
    """Pages that ``free()`` empties within a step (``begin()`` ... ``end()``) stay backed and charged when
    the step ends: the GPU work of that step may still read them. The next step's end releases them."""
    charged = ledger.charged_bytes
    begin()
    free()
    end()
    assert ledger.charged_bytes == charged  # deferred: pages still backed
    begin()
    end()
    assert ledger.charged_bytes < charged


@pytest.mark.usefixtures("elastic_pool_env")
def test_cuda_pool_roundtrip_and_deferred_release() -> None:
    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    pool = ElasticMHATokenToKVPool(65536, 16, torch.bfloat16, H, D, LAYERS, "cuda", False)
    assert pool.k_buffer[0].is_cuda
    alloc = ElasticPagedTokenToKVPoolAllocator(65536, 16, torch.bfloat16, "cuda", pool, False)
    slots = alloc.alloc(4096)
    assert slots is not None

    class Layer:
        layer_id = 2

    k = torch.randn(4096, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(4096, H, D, device="cuda", dtype=torch.bfloat16)
    pool.set_kv_buffer(Layer(), slots, k, v)
    got_k, got_v = pool.get_kv_buffer(2)
    torch.cuda.synchronize()
    assert torch.equal(got_k[slots], k) and torch.equal(got_v[slots], v)

    ledger = pool.elastic.ledger
    # A step is SGLang's free group: its frees wait for the next group's end (GPU work in flight).
    _assert_frees_wait_a_step(ledger, alloc.free_group_begin, alloc.free_group_end, lambda: alloc.free(slots))
    alloc.clear()
    assert ledger.snapshot().mapped_pages == 1
    pool.elastic.close()


@pytest.mark.usefixtures("elastic_pool_env")
def test_cuda_mamba_state_pool_fused_slot_ops_and_deferred_release() -> None:
    """The state super-cell on a GPU: bf16 conv states take SGLang's fused slot kernels (clear / copy),
    which must describe the elastic tensors (not the one-slot tensors SGLang's constructor built first),
    and a freed slot's page stays mapped until the step that may still read it has finished."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang_elastic_kv.mamba import ElasticHybridReqToTokenPool

    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=4096, n_groups=16, num_heads=32, head_dim=128, state_size=128,
        conv_kernel=4,
    )  # fmt: skip
    params = Mamba2CacheParams(
        shape=shape, layers=[0, 1, 2], dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    )
    pool = ElasticHybridReqToTokenPool(
        size=64, mamba_size=1024, mamba_spec_state_size=64, max_context_len=4096, device="cuda",
        enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0, 1, 2],
        enable_mamba_extra_buffer=False, enable_overlap_schedule=True,
    )  # fmt: skip
    mamba = pool.mamba_pool
    assert mamba.mamba_cache.temporal.is_cuda and mamba.mamba_cache.temporal.shape[1] == 1025
    alloc = pool.mamba_allocator
    slots = alloc.alloc(300)
    assert slots is not None
    src, dst = slots[:100], slots[100:200]
    for t in [*mamba.mamba_cache.conv, mamba.mamba_cache.temporal]:
        t[:, src] = 3
    mamba.copy_from(src, dst)  # fused on CUDA bf16 conv
    mamba.clear_slots(src)
    torch.cuda.synchronize()
    for t in [*mamba.mamba_cache.conv, mamba.mamba_cache.temporal]:
        assert bool((t[:, dst] == 3).all()) and bool((t[:, src] == 0).all())

    ledger = mamba.elastic.ledger
    _assert_frees_wait_a_step(
        ledger, alloc.elastic_step_begin, alloc.elastic_step_end, lambda: alloc.free(slots)
    )
    pool.clear()
    assert ledger.snapshot().mapped_pages == 1
    mamba.elastic.close()
