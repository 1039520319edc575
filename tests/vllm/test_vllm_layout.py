"""Worker-side pieces without an engine: the allocation context, the geometry of vLLM's own views, the
zeroing of newly mapped pages, and the model-feature refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.errors import ConfigError
from vllm_elastic_kv.config import PluginConfig
from vllm_elastic_kv.layout import (
    AUTO_PAGE_BYTES,
    check_plan,
    observed_geometry,
    planned_geometry,
    pool_geometry,
    reserve_min_pages,
    view_families,
)
from vllm_elastic_kv.worker.allocation import KVAllocation, planned_allocations
from vllm_elastic_kv.worker.worker_pool import _ZeroingTarget

pytestmark = pytest.mark.vllm

KIB = 1024


def _config(layout: str, num_blocks: int = 40, specs: list[Any] | None = None) -> Any:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    specs = specs or [FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)]
    groups = [KVCacheGroupSpec([f"g{g}.l{i}" for i in range(3)], s) for g, s in enumerate(specs)]
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = layout
    per_block = sum(3 * s.page_size_bytes for s in specs)
    cfg = get_kv_cache_config_from_groups(vllm_config, groups, num_blocks * per_block // len(specs) + 100)
    cfg.kv_cache_layout = layout
    return cfg, vllm_config


def _allocate_in_spaces(cfg: Any, page: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """vLLM's own allocate_kv_cache, inside the elastic allocation context, over host spaces."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    backend = _vmm.HostBackend()
    ctx = KVAllocation(
        planned_allocations(cfg, "one_buffer"),
        torch.device("cpu"),
        lambda n: _vmm.TensorSpace(backend, -(-n // page) * page, page),
    )
    with ctx:
        caches = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[cfg.kv_cache_layout])
    assert len(ctx.spaces) == 1
    return caches, ctx.spaces


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC", "BLHNC", "BHLNC"])
def test_plan_matches_the_views_vllm_builds(layout: str) -> None:
    page = 16 * KIB
    cfg, vllm_config = _config(layout)
    caches, spaces = _allocate_in_spaces(cfg, page)
    planned = planned_geometry(cfg, vllm_config, "one_buffer", page, max_page_slots=8)
    space = spaces[0]
    observed = observed_geometry(
        list(caches.values()), [space.base], [space.size], cfg.num_blocks, page, planned.blocks_per_page
    )
    check_plan(planned, observed)
    assert planned.extent_tuples() == observed.extent_tuples()
    # Every block's bytes, as vLLM's views address them, lie inside its page.
    flat = torch.from_dlpack(space)
    group = _vmm.SpaceGroup(
        [space], observed.extent_tuples(), observed.num_pages, _vmm.HandlePool(space.backend, 0)
    )
    group.map(list(range(observed.num_pages)))
    for block in (1, cfg.num_blocks // 2, cfg.num_blocks - 1):
        flat.zero_()
        for view in caches.values():
            view[block].view(torch.uint8).fill_(1)
        painted = flat.nonzero().flatten()
        inside = torch.zeros_like(flat, dtype=torch.bool)
        for _, lo, hi in observed.page_ranges(observed.page_of(block)):
            inside[lo:hi] = True
        assert bool(inside[painted].all())
    group.close()


def test_allocation_context_passes_other_calls_and_checks_the_plan() -> None:
    backend = _vmm.HostBackend()
    ctx = KVAllocation([8192], torch.device("cpu"), lambda n: _vmm.TensorSpace(backend, n, 4096))
    with ctx:
        other = torch.zeros(8192, dtype=torch.float32)  # not int8: vLLM's, not ours
        small = torch.zeros(100, dtype=torch.int8)  # not a planned size
        kv = torch.zeros(8192, dtype=torch.int8, device="cpu")
    assert kv.data_ptr() == ctx.spaces[0].base and kv.dtype is torch.int8 and not bool(kv.any())
    assert other.data_ptr() != kv.data_ptr() and small.numel() == 100
    missing = KVAllocation([4096, 8192], torch.device("cpu"), lambda n: _vmm.TensorSpace(backend, n, 4096))
    with pytest.raises(ConfigError, match=r"allocations of \[4096\] bytes never came"), missing:
        torch.zeros(8192, dtype=torch.int8, device="cpu")


def test_per_tensor_plan_is_0_26_packed_kv() -> None:
    """vLLM 0.26-0.28 on NVIDIA: every backend views a layer's buffer as (num_blocks, H, N, 2*D).

    Seen on the H200 with vLLM 0.26's FlashAttention: a plan of K and V halves was refused at start-up by
    :func:`check_plan` (different bytes per page); the default plan keeps a block's K and V together.
    """
    nb = 48
    cfg = _per_tensor_config(2, nb)
    layer = cfg.kv_cache_tensors[0].size
    page = 16 * KIB
    planned = planned_geometry(cfg, None, "per_tensor", page, max_page_slots=8)
    backend = _vmm.HostBackend()
    spaces = [_vmm.TensorSpace(backend, layer, page) for _ in range(2)]
    packed = [torch.from_dlpack(s).view(torch.float16)[: layer // 2].view(nb, 2, 16, 2 * 64) for s in spaces]
    bases, sizes = [s.base for s in spaces], [s.size for s in spaces]
    observed = observed_geometry(packed, bases, sizes, nb, page, planned.blocks_per_page, "per_tensor")
    check_plan(planned, observed)
    assert observed.extent_tuples() == planned.extent_tuples()
    halves = planned_geometry(cfg, None, "per_tensor", page, max_page_slots=8, split_kv=True)
    with pytest.raises(ConfigError, match=r"disagree on pages|differently from the plan"):
        check_plan(halves, observed)


def test_per_tensor_plan_kv_halves() -> None:
    """vLLM 0.26-0.28: one buffer per layer; ROCm attention views it as (2, num_blocks, ...)."""
    nb = 32
    cfg = _per_tensor_config(2, nb)
    layer = cfg.kv_cache_tensors[0].size
    page = 16 * KIB
    planned = planned_geometry(cfg, None, "per_tensor", page, max_page_slots=8, split_kv=True)
    backend = _vmm.HostBackend()
    spaces = [_vmm.TensorSpace(backend, layer, page) for _ in range(2)]
    views = [torch.from_dlpack(s).view(torch.float16)[: layer // 2].view(2, nb, 16, 2, 64) for s in spaces]
    observed = observed_geometry(
        views,
        [s.base for s in spaces],
        [s.size for s in spaces],
        nb,
        page,
        planned.blocks_per_page,
        "per_tensor",
    )
    check_plan(planned, observed)
    # A backend that keeps K and V of a block together maps different bytes per page (the worker maps
    # what its views address), at the same cost: accepted.
    unsplit = [torch.from_dlpack(s).view(torch.float16)[: layer // 2].view(nb, 2, 16, 2, 64) for s in spaces]
    bases, sizes = [s.base for s in spaces], [s.size for s in spaces]
    other = observed_geometry(unsplit, bases, sizes, nb, page, planned.blocks_per_page, "per_tensor")
    assert other.extent_tuples() != planned.extent_tuples()
    check_plan(planned, other)
    # Views that address a different amount per page would make the scheduler charge wrongly: refused.
    k_only = [v[0] for v in views]
    with pytest.raises(ConfigError, match="differently from the plan"):
        check_plan(
            planned, observed_geometry(k_only, bases, sizes, nb, page, planned.blocks_per_page, "per_tensor")
        )


def test_block_axis_must_be_unambiguous() -> None:
    t = torch.zeros(2, 2, 16)
    with pytest.raises(ConfigError, match="block axis"):
        view_families(t, 0, t.data_ptr(), 2, "per_tensor")


def test_zeroing_target_zeroes_exactly_the_new_pages_blocks() -> None:
    page = 4 * KIB
    backend = _vmm.HostBackend()
    space = _vmm.TensorSpace(backend, 64 * KIB, page)
    from elastic_kv.geometry import BlockFamily, BlockGeometry

    # Two interleaved families (stride 2 KiB, 1 KiB each): block b's bytes are not one run.
    geo = BlockGeometry(
        [64 * KIB], [BlockFamily(0, 0, 2 * KIB, KIB), BlockFamily(0, KIB, 2 * KIB, KIB)], 32, page
    )
    group = _vmm.SpaceGroup([space], geo.extent_tuples(), geo.num_pages, _vmm.HandlePool(backend, 1 << 20))
    flat = torch.from_dlpack(space)
    target = _ZeroingTarget(group, geo, [flat])
    target.map([0, 1])
    flat[: 2 * geo.blocks_per_page * 2 * KIB].fill_(7)
    target.unmap([1])  # its handle goes to the pool with 7s in it
    target.map([1])  # reused handle: zeroed
    first = slice(0, geo.blocks_per_page * 2 * KIB)
    second = slice(first.stop, 2 * first.stop)
    assert bool((flat[first] == 7).all()) and not bool(flat[second].any())
    assert target.num_mapped == 2  # everything else is the group's
    group.close()


def test_zeroing_target_zeroes_runs_of_neighbouring_pages_and_nothing_between() -> None:
    page = 4 * KIB
    backend = _vmm.HostBackend()
    space = _vmm.TensorSpace(backend, 64 * KIB, page)
    from elastic_kv.geometry import BlockFamily, BlockGeometry

    geo = BlockGeometry([64 * KIB], [BlockFamily(0, 0, KIB, KIB)], 64, page)  # dense: 4 blocks a page
    group = _vmm.SpaceGroup([space], geo.extent_tuples(), geo.num_pages, _vmm.HandlePool(backend, 1 << 20))
    flat = torch.from_dlpack(space)
    target = _ZeroingTarget(group, geo, [flat])
    target.map(range(6))
    flat[: 6 * page].fill_(7)
    target.unmap([1, 2, 4])
    target.map([4, 1, 2])  # reused handles, out of order: pages 1-2 are one run, page 4 another
    per_page = flat[: 6 * page].view(6, page)
    assert [bool(per_page[p].any()) for p in range(6)] == [True, False, False, True, False, True]
    assert bool((per_page[[0, 3, 5]] == 7).all())
    group.close()


def _per_tensor_config(num_layers: int, num_blocks: int, kv_heads: int = 2, head_size: int = 64) -> Any:
    """A 0.26-style KVCacheConfig: one tensor per layer, 16-token blocks (8 KiB by default)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.float16)

    class Tensor026:  # KVCacheTensor of 0.26: (size, shared_by, offset, block_stride)
        def __init__(self, name: str) -> None:
            self.size, self.shared_by = num_blocks * spec.page_size_bytes, [name]
            self.offset = self.block_stride = 0

    names = [f"l{i}" for i in range(num_layers)]
    return KVCacheConfig(num_blocks, [Tensor026(n) for n in names], [KVCacheGroupSpec(names, spec)])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("layers", "slot_mib"), [(2, 8), (8, 8), (22, 8), (32, 8), (48, 4), (64, 4), (80, 2), (160, 2)]
)
def test_automatic_slot_size_keeps_pages_within_256_mib(layers: int, slot_mib: int) -> None:
    """GPUs without a configured page size: the fewest driver handles whose page stays within 256 MiB."""
    cfg = _per_tensor_config(layers, num_blocks=16384)
    elastic = ElasticConfig()  # 2 MiB slots
    configured = pool_geometry(cfg, None, "per_tensor", elastic, auto_page_size=False)
    assert configured.page_size == 2 << 20 and configured.page_bytes == layers * (2 << 20)
    auto = pool_geometry(cfg, None, "per_tensor", elastic, auto_page_size=True)
    assert auto.page_size == slot_mib << 20
    assert auto.page_bytes == layers * auto.page_size <= max(AUTO_PAGE_BYTES, configured.page_bytes)
    assert auto.blocks_per_page == configured.blocks_per_page * (slot_mib // 2)


def test_chosen_names_the_settings_the_user_set() -> None:
    """Only these settings are sized automatically on GPUs when the user leaves them unset."""
    assert PluginConfig.resolve({}, {}).chosen == frozenset()
    env = {"ELASTIC_KV_PAGE_SIZE": "4M", "ELASTIC_KV_RESERVE_MIN": "0", "ELASTIC_KV_LIMIT": "1G"}
    assert PluginConfig.resolve({}, env).chosen == {"page_size", "reserve_min_pages"}
    options = {"elastic_kv": {"page_size": "4M", "reserve_min_pages": 2}}
    assert PluginConfig.resolve(options, {}).chosen == {"page_size", "reserve_min_pages"}
    assert PluginConfig.resolve({}, {"ELASTIC_KV_LIMIT": "1G"}).chosen == set()
    # The headroom kept free on GPUs is sized to the device unless the user sets it.
    assert PluginConfig.resolve({}, {"ELASTIC_KV_MIN_FREE": "0"}).chosen == {"min_free_bytes"}


def test_gpu_minimum_reserve_covers_one_scheduler_step() -> None:
    """On GPUs the default minimum reserve is the pages one step's ``max_num_batched_tokens`` fill;
    a user's setting, and every backend off GPUs, keep the configured value."""
    from vllm.config import VllmConfig

    cfg = _per_tensor_config(32, num_blocks=16384, kv_heads=8, head_size=128)  # Llama-3-8B: 64 KiB blocks
    vllm_config = VllmConfig()
    vllm_config.scheduler_config.max_num_batched_tokens = 16384  # vLLM's offline default on an H200
    plugin = PluginConfig.resolve({}, {})
    geo = pool_geometry(cfg, vllm_config, "per_tensor", plugin.elastic, auto_page_size=True)
    assert geo.blocks_per_page == 128  # 32 slots of 8 MiB, 8 KiB blocks: a 256 MiB page
    assert reserve_min_pages(plugin, vllm_config, cfg, geo, gpu=True) == 8  # 1024 blocks
    assert reserve_min_pages(plugin, vllm_config, cfg, geo, gpu=False) == 1
    vllm_config.scheduler_config.max_num_batched_tokens = 16384 + 1  # one more block: a ninth page
    assert reserve_min_pages(plugin, vllm_config, cfg, geo, gpu=True) == 9
    vllm_config.scheduler_config.max_num_batched_tokens = 16
    assert reserve_min_pages(plugin, vllm_config, cfg, geo, gpu=True) == 1
    vllm_config.scheduler_config.max_num_batched_tokens = 1 << 20  # capped by the reserve's maximum
    assert reserve_min_pages(plugin, vllm_config, cfg, geo, gpu=True) == plugin.elastic.reserve_max_pages
    for chosen in ({"ELASTIC_KV_RESERVE_MIN": "0"}, {"ELASTIC_KV_RESERVE_MIN": "3"}):
        user = PluginConfig.resolve({}, chosen)
        value = user.elastic.reserve_min_pages
        assert reserve_min_pages(user, vllm_config, cfg, geo, gpu=True) == value
