"""The elastic SGLang pool and allocators on a CUDA device (marker ``gpu``; run where SGLang and a GPU
with VMM are both installed -- the project's GPU machine has no SGLang, see the report).

What only a GPU shows: the pool's buffers are CUDA tensors over ``CudaBackend`` spaces, SGLang's own
``set_kv_buffer`` writes through them, K and V of an allocated page are both backed, and ``defer_release``
keeps an emptied page mapped until its epoch is released."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]
sglang = pytest.importorskip("sglang")

H, D, LAYERS = 8, 128, 4


def test_cuda_pool_roundtrip_and_deferred_release(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sglang_elastic_kv.allocators import ElasticPagedTokenToKVPoolAllocator
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    tmp_path.chmod(0o700)
    monkeypatch.setenv("ELASTIC_KV_SGLANG_BACKEND", "elastic")
    monkeypatch.setenv("ELASTIC_KV_REGISTRY_DIR", str(tmp_path))
    monkeypatch.setenv("ELASTIC_KV_RESERVE_MAX", "0")
    monkeypatch.setenv("ELASTIC_KV_RESERVE_MIN", "0")
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
    charged = ledger.charged_bytes
    alloc.free_group_begin()  # a step: its frees wait for the next group's end (GPU work in flight)
    alloc.free(slots)
    alloc.free_group_end()
    assert ledger.charged_bytes == charged  # deferred: pages still backed
    alloc.free_group_begin()
    alloc.free_group_end()
    assert ledger.charged_bytes < charged
    alloc.clear()
    assert ledger.snapshot().mapped_pages == 1
    pool.elastic.close()
