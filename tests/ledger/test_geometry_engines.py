"""BlockGeometry built from the installed engines' own layouts.

The engines lay out real (CPU) tensors with their own code; each block is painted through the engine's
own per-layer views, and every painted byte must lie inside the byte ranges of the block's page. The
geometry must also describe the block exactly (no byte missing, none extra).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from elastic_kv.geometry import BlockFamily, BlockGeometry, strided_families

KIB = 1024


def check_against_engine(
    geo: BlockGeometry, storages: Sequence[torch.Tensor], paint_block: Callable[[int, int], None]
) -> None:
    """Paint every block ``b`` with the byte ``b + 1`` through the engine's own views (``storages`` are the
    flat uint8 bytes of each space), then compare with the geometry: the same bytes, all inside the page."""
    assert geo.num_blocks < 256, "one byte value per block"
    for raw in storages:
        raw.zero_()
    for block in range(geo.num_blocks):
        paint_block(block, block + 1)
    ours = [torch.zeros_like(raw) for raw in storages]
    for block in range(geo.num_blocks):
        for space, lo, hi in geo.block_ranges(block):
            ours[space][lo:hi] = block + 1
    for space, raw in enumerate(storages):
        assert torch.equal(raw, ours[space]), f"space {space}: the geometry's blocks are not the engine's"
    for page in range(geo.num_pages):
        blocks = geo.blocks_of(page)
        for space, raw in enumerate(storages):
            inside = torch.zeros(geo.space_sizes[space], dtype=torch.bool)
            for s, lo, hi in geo.page_ranges(page):
                if s == space:
                    inside[lo:hi] = True
            mine = (raw >= blocks.start + 1) & (raw <= blocks.stop)
            assert bool(inside[: raw.numel()][mine].all()), (
                f"a block of page {page} leaves it in space {space}"
            )


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


# -- vLLM 0.32 (one buffer, KVCacheTensor with layer_stride / block_stride / offset) --------------------


@pytest.fixture(scope="module")
def vllm_api():
    vllm = pytest.importorskip("vllm")
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    assert vllm.__version__.startswith("0.32"), vllm.__version__
    return {
        "config": VllmConfig(),  # costs about a second to build: one per module
        "plan": get_kv_cache_config_from_groups,
        "allocate": allocate_kv_cache,
        "strides": compute_layout_strides,
        "shape": compute_layer_kv_cache_shape_bytes,
        "Group": KVCacheGroupSpec,
        "Full": FullAttentionSpec,
        "MLA": MLAAttentionSpec,
        "SWA": SlidingWindowSpec,
        "Layout": KVCacheLayout,
    }


def vllm_geometry(api: dict, cfg, layout, page_size: int) -> BlockGeometry:
    """What the vLLM plugin does: one family list per KVCacheTensor, from vLLM's own stride helper."""
    families: list[BlockFamily] = []
    for tensor in cfg.kv_cache_tensors:
        group = next(g for g in cfg.kv_cache_groups if tensor.layers[0] in g.layer_names)
        spec = group.kv_cache_spec
        num_layers = len(tensor.layers)
        strides = api["strides"](
            spec,
            cfg.num_blocks,
            num_layers,
            layout,
            fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None),
        )
        shape = (num_layers, *api["shape"](spec, cfg.num_blocks))
        axes = [(shape[i], strides[i]) for i in (0, 2, 3, 4)]
        families += strided_families(0, tensor.offset, strides[1], axes)
    return BlockGeometry(
        [cfg.kv_cache_tensors[0].size], families, cfg.num_blocks, page_size, max_page_slots=64
    )


def vllm_specs(api: dict) -> dict[str, list]:
    full = api["Full"]
    return {
        "full-64": [full(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)],
        "full-80": [full(block_size=16, num_kv_heads=3, head_size=80, dtype=torch.float16)],  # 15 KiB pages
        "mla": [api["MLA"](block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)],
        "hybrid": [
            full(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16),
            api["SWA"](block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=64),
        ],
    }


@pytest.mark.vllm
@pytest.mark.parametrize("spec_name", ["full-64", "full-80", "mla", "hybrid"])
@pytest.mark.parametrize("layout_name", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("page_size", [4 * KIB, 64 * KIB])
def test_vllm_layouts(vllm_api: dict, spec_name: str, layout_name: str, page_size: int) -> None:
    layout = vllm_api["Layout"][layout_name]
    specs = vllm_specs(vllm_api)[spec_name]
    groups = [vllm_api["Group"]([f"g{g}.l{i}" for i in range(3)], spec) for g, spec in enumerate(specs)]
    vllm_config = vllm_api["config"]
    vllm_config.cache_config.kv_cache_layout = layout_name
    per_block = sum(3 * spec.page_size_bytes for spec in specs)
    cfg = vllm_api["plan"](vllm_config, groups, 37 * per_block // len(specs) + 100)
    caches = vllm_api["allocate"](cfg, torch.device("cpu"), layout)
    geo = vllm_geometry(vllm_api, cfg, layout, page_size)
    assert geo.num_blocks == cfg.num_blocks
    raw = flat_bytes(next(iter(caches.values())))

    def paint(block: int, value: int) -> None:
        for view in caches.values():
            view[block].view(torch.uint8).fill_(value)

    check_against_engine(geo, [raw], paint)


# -- SGLang 0.5.23 (one allocation per layer: K and V halves, or separate K/V, or MLA latents) ----------


@pytest.fixture(scope="module")
def sglang_pools():
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    except ImportError as exc:  # SGLang 0.5.23 imports torchvision at module level (docs/cpu-engines.md)
        pytest.skip(f"SGLang's memory pool does not import here: {exc}")
    return MHATokenToKVPool, MLATokenToKVPool


def sglang_geometry(
    buffers: list[list[torch.Tensor]], rows_per_block: int, num_blocks: int, page_size: int
) -> BlockGeometry:
    """What the SGLang plugin does: one space per storage; one row array per K/V (or latent) tensor."""
    storages: list[int] = []
    sizes: list[int] = []
    offsets: list[list[int]] = []
    row_bytes = buffers[0][0].stride(0) * buffers[0][0].element_size()
    for layer_tensors in buffers:
        for t in layer_tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in storages:
                storages.append(ptr)
                sizes.append(int(t.untyped_storage().nbytes()))
                offsets.append([])
            offsets[storages.index(ptr)].append(int(t.storage_offset()) * t.element_size())
    return BlockGeometry.from_token_buffers(sizes, offsets, row_bytes, rows_per_block, num_blocks, page_size)


@pytest.mark.sglang
# (SGLang 0.5.23 itself refuses 'hnd' with pages of several tokens for this pool: _build_kv_buffer_descs)
@pytest.mark.parametrize(("layout", "sgl_page"), [("nhd", 1), ("nhd", 4), ("hnd", 1)])
def test_sglang_mha_layouts(sglang_pools, layout: str, sgl_page: int) -> None:
    mha, _ = sglang_pools
    pool = mha(
        size=200,
        page_size=sgl_page,
        dtype=torch.float16,
        head_num=2,
        head_dim=64,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
        kv_cache_layout=layout,
    )
    buffers = [[pool.k_buffer[i], pool.v_buffer[i]] for i in range(3)]
    rows_per_block = sgl_page if layout == "nhd" else 1
    num_blocks = pool.k_buffer[0].shape[0] // rows_per_block
    geo = sglang_geometry(buffers, rows_per_block, num_blocks, 4 * KIB)
    storages = [flat_bytes(buffers[i][0]) for i in range(3)]

    def paint(block: int, value: int) -> None:
        rows = slice(block * rows_per_block, (block + 1) * rows_per_block)
        for k, v in buffers:
            k[rows].view(torch.uint8).fill_(value)
            v[rows].view(torch.uint8).fill_(value)

    check_against_engine(geo, storages, paint)


@pytest.mark.sglang
def test_sglang_mla_layout(sglang_pools) -> None:
    _, mla = sglang_pools
    pool = mla(
        size=200,
        page_size=4,
        dtype=torch.bfloat16,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    buffers = [[pool.kv_buffer[i]] for i in range(2)]
    num_blocks = pool.kv_buffer[0].shape[0] // 4
    geo = sglang_geometry(buffers, 4, num_blocks, 4 * KIB)
    storages = [flat_bytes(b[0]) for b in buffers]

    def paint(block: int, value: int) -> None:
        for (buf,) in buffers:
            buf[block * 4 : (block + 1) * 4].view(torch.uint8).fill_(value)

    check_against_engine(geo, storages, paint)
