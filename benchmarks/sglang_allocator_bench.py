"""Per-call cost of SGLang's token allocators, native vs elastic, in-process on the host backend.

The decode path calls ``alloc(batch_size)`` once per step and frees finished requests in groups; a
ledger call per token would cost per-token Python. The elastic token allocator instead takes ledger
blocks of ``ELASTIC_KV_SGLANG_TOKEN_CHUNK`` slots; this measures one step (alloc of ``BATCH`` slots) and
one request-sized free for several chunk sizes, against SGLang's own allocator on the same pool shape.

    python -m pytest benchmarks/sglang_allocator_bench.py --benchmark-columns=median,ops
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

SIZE = 65536
BATCH = 32  # decode step: one slot per running request
REQUEST = 512  # a finished request's slots, freed in one group


def _pool(elastic: bool, monkeypatch: pytest.MonkeyPatch, registry: Path, chunk: int) -> Any:
    if elastic:
        from sglang_elastic_kv.pool import ElasticMHATokenToKVPool as cls
    else:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool as cls
    monkeypatch.setenv("ELASTIC_KV_SGLANG_TOKEN_CHUNK", str(chunk))
    monkeypatch.setenv("ELASTIC_KV_PAGE_SIZE", "64K")
    monkeypatch.setenv("ELASTIC_KV_REGISTRY_DIR", str(registry))
    return cls(SIZE, 1, torch.float32, 2, 32, 2, "cpu", False)


def _allocator(elastic: bool, pool: Any) -> Any:
    if elastic:
        from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator as cls
    else:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator as cls
    return cls(SIZE, torch.float32, "cpu", pool, False)


def _cycle(alloc: Any) -> Callable[[], None]:
    """One request's life: REQUEST // BATCH decode steps of BATCH slots, then one grouped free."""

    def run() -> None:
        held = [alloc.alloc(BATCH) for _ in range(REQUEST // BATCH)]
        alloc.free_group_begin()
        alloc.free(torch.cat(held))
        alloc.free_group_end()

    return run


@pytest.mark.parametrize(
    ("elastic", "chunk"),
    [(False, 0), (True, 16), (True, 64), (True, 256)],
    ids=["native", "c16", "c64", "c256"],
)
def test_alloc_free_cycle(
    benchmark: Any, elastic: bool, chunk: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tmp_path.chmod(0o700)
    pool = _pool(elastic, monkeypatch, tmp_path, max(chunk, 1))
    alloc = _allocator(elastic, pool)
    benchmark(_cycle(alloc))
    assert alloc.available_size() == SIZE
