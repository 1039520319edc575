"""Property tests over the vLLM plugin's whole planning path, for any shape vLLM accepts.

Each example builds a ``KVCacheConfig`` with vLLM's own code (``get_kv_cache_config_from_groups`` after
``CpuPlatform.check_and_update_config`` resolved ``kv_cache_memory_bytes`` against
``VLLM_CPU_KVCACHE_SPACE``), plans it as the scheduler does (``pool_geometry``), lets the worker
(:class:`~vllm_elastic_kv.worker.worker_pool.WorkerPool`) reserve its spaces and serve vLLM's own
``allocate_kv_cache`` from them, and builds the data plane's ``SpaceGroup`` over the views vLLM bound. It
checks that:

* every block of every layer lies inside its page's byte ranges, and every page inside its space;
* pages tile the blocks (consecutive, every block in exactly one page, only the last page short);
* the plan equals what vLLM binds (same pages, same extents, same bytes per block);
* the pages the data plane backs hold the blocks' bytes: writing every block of the first and the last
  page through vLLM's views lands in backed memory, and nowhere else.

vLLM 0.26-0.28 (one buffer per layer, the attention backend's view; the H200 runs 0.26) is covered by the
per-tensor plan on GPU slot sizes; the worker's views there are the packed ``(num_blocks, ...)`` pages that
every NVIDIA backend of 0.26 binds, or ROCm's ``(2, num_blocks, ...)`` K and V halves.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.errors import ConfigError
from elastic_kv.geometry import BlockGeometry
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from vllm_elastic_kv import compat
from vllm_elastic_kv.config import PluginConfig
from vllm_elastic_kv.layout import (
    check_plan,
    check_spaces,
    observed_geometry,
    planned_spaces,
    pool_geometry,
)
from vllm_elastic_kv.worker.allocation import KVAllocation
from vllm_elastic_kv.worker.worker_pool import WorkerPool

pytestmark = pytest.mark.vllm

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# The host data plane tiles an unbacked space with one mapping per slot: keep examples well within the
# kernel's map count (vm.max_map_count, 65530 by default) and quick to reserve.
MAX_SLOTS = 16384
PROPERTIES = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89]
LAYERS = st.one_of(st.integers(1, 96), st.sampled_from([1, 3, 5, 7, 95, 96, *PRIMES]))
# KV cache dtypes: fp32, bf16, fp16 and fp8 (vLLM stores fp8 KV as uint8 with a per-tensor scale).
DTYPES = st.sampled_from(["float32", "bfloat16", "float16", "fp8"])
SLOTS = st.sampled_from([4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 2 * MIB, 8 * MIB])


@dataclass(frozen=True)
class Shape:
    """One model's attention shape as vLLM's KV cache spec sees it."""

    layers: int
    kv_heads: int
    head_size: int
    dtype: str
    block_size: int

    def spec(self) -> Any:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

        if self.dtype == "fp8":
            dtype, quant = torch.uint8, KVQuantMode.FP8_PER_TENSOR
        else:
            dtype, quant = getattr(torch, self.dtype), KVQuantMode.NONE
        return FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.kv_heads,
            head_size=self.head_size,
            dtype=dtype,
            kv_quant_mode=quant,
        )


def cpu_head_sizes() -> list[int]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


@st.composite
def cpu_shapes(draw: st.DrawFn) -> Shape:
    """Shapes vllm-cpu serves: its attention's head sizes, block sizes a multiple of 32 (its kernels)."""
    return Shape(
        layers=draw(LAYERS),
        kv_heads=draw(st.integers(1, 16)),
        head_size=draw(st.sampled_from(cpu_head_sizes())),
        dtype=draw(DTYPES),
        block_size=draw(st.sampled_from([32, 64, 96, 128, 256])),
    )


@st.composite
def gpu_shapes(draw: st.DrawFn) -> Shape:
    """Shapes the NVIDIA backends serve: head sizes a multiple of 8 up to 256 (and 512), blocks of 16-64."""
    return Shape(
        layers=draw(LAYERS),
        kv_heads=draw(st.integers(1, 16)),
        head_size=draw(st.one_of(st.integers(1, 32).map(lambda k: 8 * k), st.just(512))),
        dtype=draw(DTYPES.filter(lambda d: d != "float32")),
        block_size=draw(st.sampled_from([16, 32, 64])),
    )


@st.composite
def kv_memory(draw: st.DrawFn, block_bytes: int) -> tuple[int, int | None]:
    """``(kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE or None)``: a byte count that is no multiple of a
    block, a slot or a page, and sometimes the CPU variable beside it, which vLLM lets override it."""
    blocks = draw(st.integers(1, 3000))
    extra = draw(st.integers(0, block_bytes - 1))
    gib = draw(st.one_of(st.none(), st.integers(1, 3)))
    return blocks * block_bytes + extra, gib


class _Env(dict):  # type: ignore[type-arg]
    """vLLM's config and platform, shared by the examples (a short repr: hypothesis prints arguments)."""

    def __repr__(self) -> str:
        return "vllm_env"


@pytest.fixture(scope="module")
def vllm_env() -> Iterator[dict[str, Any]]:
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    vllm = pytest.importorskip("vllm")
    assert vllm.__version__.startswith("0.32"), vllm.__version__
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the small tensor ops here only contend for the cores in parallel
    yield _Env(config=VllmConfig(), platform=current_platform)  # a VllmConfig costs seconds: one
    torch.set_num_threads(threads)


def resolved_kv_bytes(env: dict[str, Any], memory: int, cpu_gib: int | None) -> int:
    """The KV cache bytes vLLM sizes the cache with: ``kv_cache_memory_bytes`` after the CPU platform's
    own ``check_and_update_config`` applied ``VLLM_CPU_KVCACHE_SPACE`` (when set, it wins)."""
    cache = env["config"].cache_config
    cache.kv_cache_memory_bytes = memory
    with pytest.MonkeyPatch.context() as mp:
        if cpu_gib is None:
            mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        else:
            mp.setenv("VLLM_CPU_KVCACHE_SPACE", str(cpu_gib))
        env["platform"].check_and_update_config(env["config"])
    return int(cache.kv_cache_memory_bytes)


def kv_cache_config(env: dict[str, Any], shape: Shape, available: int, layout: str) -> Any:
    """vLLM's KVCacheConfig for one group of ``shape.layers`` full-attention layers."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    vllm_config = env["config"]
    vllm_config.cache_config.kv_cache_layout = layout
    names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
    cfg = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(names, shape.spec())], available)
    cfg.kv_cache_layout = layout
    return cfg


def plan_or_refuse(plan: Any) -> BlockGeometry:
    """``plan()``; a block larger than a logical page is refused with the fix named (and the example is
    dropped): the only refusal a full-attention shape may get."""
    try:
        return plan()  # type: ignore[no-any-return]
    except ConfigError as exc:
        assert "ELASTIC_KV_PAGE_SIZE" in str(exc) and "a block needs" in str(exc)
        assume(False)
        raise


def assert_pages_tile_blocks(geo: BlockGeometry) -> None:
    """Pages hold consecutive blocks, every block exactly one page, only the last page short."""
    bpp = geo.blocks_per_page
    assert geo.num_pages == math.ceil(geo.num_blocks / bpp)
    assert geo.blocks_of(0).start == 0 and geo.blocks_of(geo.num_pages - 1).stop == geo.num_blocks
    for page in {0, 1, geo.num_pages - 2, geo.num_pages - 1} & set(range(geo.num_pages)):
        blocks = geo.blocks_of(page)
        assert blocks.start == page * bpp and all(geo.page_of(b) == page for b in (blocks[0], blocks[-1]))
        assert len(blocks) == bpp or page == geo.num_pages - 1


def assert_blocks_inside(geo: BlockGeometry, space_sizes: list[int]) -> None:
    """Every byte of every block of every layer family lies inside its page, every page inside its space.

    Family ``i``'s blocks lie in extent ``i`` of their page. Within a family a block's offset in its page
    is linear in the block id, and every page but the last is a translate of page 0: the first and last
    block of the first and the last page bound them all."""
    last = geo.num_pages - 1
    for page in {0, last}:
        ranges = geo.page_ranges(page)
        for space, lo, hi in ranges:
            assert 0 <= lo < hi <= space_sizes[space], (page, space, lo, hi, space_sizes[space])
        blocks = geo.blocks_of(page)
        for block in (blocks[0], blocks[-1]):
            for (space, start, end), (s, lo, hi) in zip(geo.block_ranges(block), ranges, strict=True):
                assert s == space and lo <= start and end <= hi, (block, page, start, end, lo, hi)


def _inside(ranges: list[tuple[int, int]], byte: int) -> bool:
    """Whether ``byte`` lies in one of the sorted, disjoint ``(start, end)`` ranges."""
    i = bisect.bisect_right(ranges, (byte, math.inf)) - 1
    return i >= 0 and ranges[i][0] <= byte < ranges[i][1]


def assert_views_inside_pages(geo: BlockGeometry, views: list[torch.Tensor], base: int) -> None:
    """vLLM's own views of a block (its first and last byte in each layer) lie inside the block's page,
    and the views' bytes of a block add up to the geometry's bytes per block."""
    for block in {0, geo.num_blocks - 1, geo.blocks_of(geo.num_pages - 1).start}:
        ranges = sorted((lo, hi) for _, lo, hi in geo.page_ranges(geo.page_of(block)))
        total = 0
        for view in views:
            cell = view[block]
            es = cell.element_size()
            first = cell.data_ptr() - base
            last = first + sum((n - 1) * s for n, s in zip(cell.shape, cell.stride(), strict=True)) * es + es
            total += cell.numel() * es
            assert _inside(ranges, first) and _inside(ranges, last - 1), (block, first, last)
        assert total == geo.block_bytes


def assert_backed_page_holds_blocks(
    pool: WorkerPool, views: list[torch.Tensor], flat: torch.Tensor, page: int
) -> None:
    """Back ``page``, write every byte of its blocks through vLLM's views and find every write inside the
    page's byte ranges; then clear and release it again."""
    geo = pool.geometry
    assert geo is not None and pool.group is not None
    pool.group.map([page])
    try:
        blocks = geo.blocks_of(page)
        written = 0
        for view in views:
            cells = view[blocks.start : blocks.stop].view(torch.uint8)
            cells.fill_(1)
            written += cells.numel()
        found = 0
        for _, lo, hi in geo.page_ranges(page):
            found += int(torch.count_nonzero(flat[lo:hi]))
            flat[lo:hi].zero_()
        assert found == written, f"page {page}: {written - found} bytes of its blocks lie outside it"
    finally:
        pool.group.unmap([page])


@contextmanager
def worker_pool(cfg: Any, vllm_config: Any, slot: int, name: str) -> Iterator[tuple[WorkerPool, list[Any]]]:
    """The worker side as vLLM runs it: WorkerPool's allocation context around vLLM's own
    ``allocate_kv_cache``, then ``finish`` with the views it built; closed at exit."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    plugin = PluginConfig.resolve(
        {"elastic_kv": {"instance": name, "page_size": slot, "reserve_min_pages": 0}}, {}
    )
    support = compat.support_for(compat.installed_version())
    pool = WorkerPool(plugin, support, cfg, vllm_config, torch.device("cpu"), 0)
    try:
        with pool.allocation():
            caches = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[cfg.kv_cache_layout])
        views = list(caches.values())
        pool.finish(views)
        yield pool, views
    finally:
        pool.close()


_EXAMPLES = itertools.count()


def check_one_buffer(
    env: dict[str, Any], shape: Shape, memory: int, cpu_gib: int | None, layout: str, slot: int
):
    """The whole 0.29+ planning path for one example (see the module docstring)."""
    available = resolved_kv_bytes(env, memory, cpu_gib)
    assert available == (cpu_gib * GIB if cpu_gib is not None else memory)
    bytes_per_layer_block = shape.spec().page_size_bytes
    assume(available >= bytes_per_layer_block * shape.layers)
    assume(available // slot <= MAX_SLOTS)
    cfg = kv_cache_config(env, shape, available, layout)
    elastic = ElasticConfig(page_size=slot)
    planned = plan_or_refuse(
        lambda: pool_geometry(cfg, env["config"], "one_buffer", elastic, auto_page_size=False)
    )
    note(f"{cfg.num_blocks} blocks; plan: {planned.describe()}")
    assert planned.num_blocks == cfg.num_blocks
    assert_pages_tile_blocks(planned)
    ((nbytes, reserved),) = planned_spaces(planned, cfg, "one_buffer")
    assert nbytes == cfg.kv_cache_tensors[0].size and reserved % slot == 0 and reserved >= nbytes
    assert_blocks_inside(planned, [reserved])
    with worker_pool(cfg, env["config"], slot, f"props{next(_EXAMPLES)}") as (pool, views):
        observed = pool.geometry
        assert observed is not None
        # The plan equals what vLLM bound: the same pages, extents, bytes per block and spaces.
        assert observed.extent_tuples() == planned.extent_tuples()
        assert observed.block_bytes == planned.block_bytes == shape.layers * bytes_per_layer_block
        assert observed.space_sizes == planned.space_sizes == (reserved,)
        space = pool.spaces[0]
        assert space.size == reserved
        assert_views_inside_pages(observed, views, space.base)
        if reserved <= 64 * MIB and len(views) <= 16:  # writing through many views is slow on 2 cores
            flat = torch.from_dlpack(space)
            for page in sorted({0, observed.num_pages - 1}):
                assert_backed_page_holds_blocks(pool, views, flat, page)


@pytest.mark.parametrize("layout", ["LBHNC"])
@PROPERTIES
@given(data=st.data())
def test_cpu_plan_holds_for_any_shape(vllm_env: dict[str, Any], layout: str, data: st.DataObject) -> None:
    """vllm-cpu's shapes and its one layout (LBHNC: layer-outer, heads-major blocks)."""
    shape = data.draw(cpu_shapes(), "shape")
    memory, cpu_gib = data.draw(kv_memory(shape.layers * shape.spec().page_size_bytes), "memory")
    slot = data.draw(SLOTS, "slot")
    check_one_buffer(vllm_env, shape, memory, cpu_gib, layout, slot)


@PROPERTIES
@given(data=st.data())
def test_every_layout_plan_holds_for_any_shape(vllm_env: dict[str, Any], data: st.DataObject) -> None:
    """The other layouts vLLM 0.29+ resolves for its GPU backends (layer-outer, head-split, block-outer),
    on GPU shapes, bound through vLLM's own allocation on the host."""
    shape = data.draw(gpu_shapes(), "shape")
    layout = data.draw(st.sampled_from(["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]), "layout")
    memory, _ = data.draw(kv_memory(shape.layers * shape.spec().page_size_bytes), "memory")
    slot = data.draw(SLOTS, "slot")
    check_one_buffer(vllm_env, shape, memory, None, layout, slot)


# -- vLLM 0.26-0.28: one buffer per layer, on GPU slot sizes --------------------------------------------


class _Tensor026:
    """``KVCacheTensor`` of vLLM 0.26: ``(size, shared_by, offset, block_stride)``, one per layer."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.shared_by, self.offset, self.block_stride = size, [name], 0, 0


def _per_tensor_views(shape: Shape, tensor: torch.Tensor, num_blocks: int, split_kv: bool) -> torch.Tensor:
    """A layer's view as 0.26's backends bind it: every NVIDIA backend keeps a block's K and V together
    (``(num_blocks, ...)``), ROCm's ``rocm_attn`` views ``(2, num_blocks, ...)`` halves."""
    dtype = shape.spec().dtype
    elems = tensor.view(dtype)
    per_block = elems.numel() // num_blocks
    if split_kv:
        return elems.view(
            2,
            num_blocks,
            shape.block_size,
            shape.kv_heads,
            per_block // 2 // shape.block_size // shape.kv_heads,
        )
    return elems.view(
        num_blocks, shape.kv_heads, shape.block_size, per_block // shape.kv_heads // shape.block_size
    )


@PROPERTIES
@given(data=st.data())
def test_per_tensor_plan_holds_for_any_shape(data: st.DataObject) -> None:
    """vLLM 0.26-0.28's allocation (one ``torch.zeros`` per layer) with the GPU's automatic slot size,
    served the way the worker serves it: spaces of the plan's sizes, the views' geometry checked against
    the plan and the spaces, and the data plane's SpaceGroup built over them."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    shape = data.draw(gpu_shapes(), "shape")
    spec = shape.spec()
    # (With two blocks the first two axes of 0.26's views, blocks and K/V, would be indistinguishable; vLLM
    # sizes no cache that small for a model of any real length.)
    num_blocks = data.draw(st.integers(3, 3000), "num_blocks")
    split_kv = data.draw(st.booleans(), "split_kv")
    auto = data.draw(st.booleans(), "auto_page_size")
    slot = data.draw(SLOTS, "slot")
    layer = num_blocks * spec.page_size_bytes
    assume(layer * shape.layers // slot <= MAX_SLOTS and layer * shape.layers <= 16 * GIB)
    names = [f"l{i}" for i in range(shape.layers)]
    cfg = KVCacheConfig(num_blocks, [_Tensor026(layer, n) for n in names], [KVCacheGroupSpec(names, spec)])  # type: ignore[list-item]
    elastic = ElasticConfig(page_size=slot)
    planned = plan_or_refuse(
        lambda: pool_geometry(cfg, None, "per_tensor", elastic, auto_page_size=auto, split_kv=split_kv)
    )
    assume(sum(planned.space_sizes) // planned.page_size <= MAX_SLOTS)
    note(planned.describe())
    assert_pages_tile_blocks(planned)
    spaces_plan = planned_spaces(planned, cfg, "per_tensor")
    assert [n for n, _ in spaces_plan] == [layer] * shape.layers
    assert_blocks_inside(planned, [size for _, size in spaces_plan])
    backend = _vmm.HostBackend()
    reserve = dict(spaces_plan)
    alloc = KVAllocation(
        [n for n, _ in spaces_plan],
        torch.device("cpu"),
        lambda n: _vmm.TensorSpace(backend, reserve[n], planned.page_size),
    )
    with alloc:
        tensors = [torch.zeros(layer, dtype=torch.int8, device="cpu") for _ in names]
    views = [_per_tensor_views(shape, t, num_blocks, split_kv) for t in tensors]
    spaces = alloc.spaces
    args = (
        views,
        [s.base for s in spaces],
        [s.size for s in spaces],
        num_blocks,
        planned.page_size,
        planned.blocks_per_page,
        "per_tensor",
    )
    if views[0].shape[0] == views[0].shape[1]:
        # A view whose first two axes both have num_blocks entries does not say which one is the blocks:
        # refused at start-up by name (a real cache has thousands of blocks, more than KV heads).
        with pytest.raises(ConfigError, match="cannot tell the block axis"):
            observed_geometry(*args)
        return
    observed = observed_geometry(*args)
    check_plan(planned, observed)
    check_spaces(observed, [s.size for s in spaces])
    assert observed.extent_tuples() == planned.extent_tuples()
    group = _vmm.SpaceGroup(spaces, observed.extent_tuples(), observed.num_pages, _vmm.HandlePool(backend, 0))
    group.close()


# -- the start-up crash of issue 19 ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("memory", "cpu_gib", "blocks", "last_page"), [(256 * MIB, None, 682, 42), (256 * MIB, 1, 2730, 170)]
)
def test_three_layer_llama_binds(
    vllm_env: dict[str, Any], memory: int, cpu_gib: int | None, blocks: int, last_page: int
) -> None:
    """The 3-layer Llama of issue 19 (hidden 256, 4 heads, 2 KV heads, fp32, 128-token blocks): 682 blocks
    of 3 x 128 KiB in 256 MiB (2730 in the 1 GiB of ``VLLM_CPU_KVCACHE_SPACE=1``), 16 blocks a 2 MiB page.
    The last page of layer 2 ends 512 KiB past the buffer rounded up to a slot; the worker reserves the
    plan's space, which covers it, and the data plane accepts the extents."""
    shape = Shape(layers=3, kv_heads=2, head_size=64, dtype="float32", block_size=128)
    available = resolved_kv_bytes(vllm_env, memory, cpu_gib)
    cfg = kv_cache_config(vllm_env, shape, available, "LBHNC")
    assert cfg.num_blocks == blocks
    planned = pool_geometry(cfg, vllm_env["config"], "one_buffer", ElasticConfig(), auto_page_size=False)
    assert (planned.blocks_per_page, planned.num_pages - 1) == (16, last_page)
    buffer = cfg.kv_cache_tensors[0].size
    rounded = -(-buffer // (2 * MIB)) * 2 * MIB
    layer2 = planned.extents[2]
    assert layer2.base + last_page * layer2.step + layer2.length == rounded + 512 * KIB
    assert planned_spaces(planned, cfg, "one_buffer") == [(buffer, rounded + 2 * MIB)]
    with worker_pool(cfg, vllm_env["config"], 2 * MIB, f"issue19x{blocks}") as (pool, views):
        assert pool.geometry is not None and pool.geometry.num_pages == last_page + 1
        space = pool.spaces[0]
        assert_backed_page_holds_blocks(pool, views, torch.from_dlpack(space), last_page)
    # A space of the allocation rounded up to a slot, as the worker used to reserve, is refused by name
    # before the data plane sees it.
    with pytest.raises(ConfigError, match="need spaces of"):
        check_spaces(planned, [rounded])
