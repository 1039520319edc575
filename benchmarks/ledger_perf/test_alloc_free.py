"""alloc + free per block: the ledger against vLLM's native BlockPool, in the same run, same trace.

    python -m pytest benchmarks/ledger_perf -q            # prints the ratio table at the end

Both allocators first take the same fragmented background load (random requests of 1-64 blocks up to
half the pool, then a third of them finished), so best-fit search, partly used pages and the reserve all
matter. Then each round allocates ``n`` blocks and frees them again (n=1: a decode step's new block;
n=16, 128: prefills). The ledger runs over the real host data plane with pre-mapping on: after warm-up
its pages cycle between use and the reserve without driver calls, as on a GPU in steady state.
The ``decode`` case is a decode step of 64 running requests: 64 allocations of one block each, then the
64 blocks freed together (as when those requests finish): the per-call cost amortised as in an engine.
Goal (issue 3): <= 1.5x native per block.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import LocalMapper

NUM_BLOCKS = 16384
KIB = 1024
SIZES = [1, 16, 128]


def background_trace(seed: int = 0) -> list[tuple[str, int]]:
    """("alloc", n) and ("free", index into the allocations) steps that leave the pool fragmented."""
    rng = random.Random(seed)
    ops: list[tuple[str, int]] = []
    used, sizes = 0, []
    while used < NUM_BLOCKS // 2:
        n = rng.randint(1, 64)
        ops.append(("alloc", n))
        sizes.append(n)
        used += n
    for index in sorted(rng.sample(range(len(sizes)), len(sizes) // 3), reverse=True):
        ops.append(("free", index))
    return ops


def replay(ops: list[tuple[str, int]], alloc: Any, free: Any) -> None:
    held: list[Any] = []
    for op, arg in ops:
        if op == "alloc":
            held.append(alloc(arg))
        else:
            free(held.pop(arg))


@pytest.fixture(scope="module")
def vllm_pool():
    block_pool = pytest.importorskip("vllm.v1.core.block_pool")
    pool = block_pool.BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    replay(background_trace(), pool.get_new_blocks, pool.free_blocks)
    return pool


@pytest.fixture(scope="module")
def ledger() -> Iterator[Ledger]:
    # 2 KiB per block and layer in 64 KiB slots: 32 blocks per page, like 64 KiB vLLM blocks in 2 MiB.
    geo = BlockGeometry.from_layer_strides(NUM_BLOCKS * 2 * KIB, NUM_BLOCKS, 1, 0, 2 * KIB, 2 * KIB, 64 * KIB)
    mapper = LocalMapper.for_geometry(_vmm.HostBackend(granularity=64 * KIB), geo)
    led = Ledger(geo, mapper, ElasticConfig(page_size=64 * KIB, reserve_min_pages=4))
    replay(background_trace(), led.alloc, led.free)
    led.settle()
    yield led
    led.close()
    mapper.close()


@pytest.mark.parametrize("n", SIZES)
def test_vllm_block_pool(benchmark, vllm_pool, record_per_block, n: int) -> None:
    get, put = vllm_pool.get_new_blocks, vllm_pool.free_blocks

    def round_trip() -> None:
        put(get(n))

    benchmark.group = f"alloc+free n={n}"
    benchmark(round_trip)
    record_per_block("vllm", n, benchmark)


DECODE = 64


def test_vllm_block_pool_decode(benchmark, vllm_pool, record_per_block) -> None:
    get, put = vllm_pool.get_new_blocks, vllm_pool.free_blocks

    def step() -> None:
        put([b for _ in range(DECODE) for b in get(1)])

    benchmark.group = "decode step: 64 x alloc(1), one free"
    benchmark(step)
    record_per_block("vllm", -DECODE, benchmark)


def test_ledger_decode(benchmark, ledger: Ledger, record_per_block) -> None:
    alloc, free = ledger.alloc, ledger.free

    def step() -> None:
        blocks: list[int] = []
        for _ in range(DECODE):
            got = alloc(1)
            assert got is not None
            blocks += got
        free(blocks)

    benchmark.group = "decode step: 64 x alloc(1), one free"
    benchmark(step)
    record_per_block("ledger", -DECODE, benchmark)


@pytest.mark.parametrize("n", SIZES)
def test_ledger(benchmark, ledger: Ledger, record_per_block, n: int) -> None:
    alloc, free = ledger.alloc, ledger.free

    def round_trip() -> None:
        blocks = alloc(n)
        assert blocks is not None
        free(blocks)

    benchmark.group = f"alloc+free n={n}"
    misses = ledger.snapshot().reserve_misses
    benchmark(round_trip)
    assert ledger.snapshot().reserve_misses == misses, "the benchmark loop waited for the driver"
    record_per_block("ledger", n, benchmark)
