"""vLLM's KV cache layout as an :class:`elastic_kv.geometry.BlockGeometry`.

:func:`pool_geometry` chooses the slot size (``page_size``) and plans with it. Two geometries of one pool
must agree on how blocks group into pages (``blocks_per_page``, ``num_pages``):

* :func:`planned_geometry` -- the scheduler's, from the ``KVCacheConfig`` alone (the engine-core process
  has no tensors). vLLM >= 0.29 describes its one backing buffer exactly (``offset``, ``layer_stride``,
  ``block_stride``, the resolved ``KVCacheLayout``), and vLLM's own ``compute_layout_strides`` gives the
  per-layer view strides, so this is exact. vLLM 0.26-0.28 allocates one buffer per ``KVCacheTensor`` and
  the attention backend decides how a layer's buffer is viewed. Every NVIDIA backend of 0.26 packs K and V
  into the last dimension of one block (``(num_blocks, H, N, 2*D)``, ``flash_attn.py:141`` in 0.26), so the
  plan keeps a block's bytes together; ROCm's ``rocm_attn`` views ``(2, num_blocks, ...)`` (K and V halves,
  ``split_kv``). The worker checks the plan against the real views either way.
* :func:`observed_geometry` -- the worker's, from the per-layer tensors vLLM actually bound to its attention
  layers (what the kernels read and write), with ``blocks_per_page`` taken from the plan. Built from the
  real views, it is right whatever the plan assumed; :func:`check_plan` then refuses at start-up a plan
  that would charge a different number of bytes than the worker backs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from elastic_kv.config import ElasticConfig
from elastic_kv.errors import ConfigError
from elastic_kv.geometry import BlockFamily, BlockGeometry, strided_families

from vllm_elastic_kv.config import PluginConfig
from vllm_elastic_kv.worker.allocation import planned_allocations

__all__ = [
    "AUTO_PAGE_BYTES",
    "check_plan",
    "check_spaces",
    "observed_geometry",
    "planned_geometry",
    "planned_spaces",
    "pool_geometry",
    "reserve_min_pages",
    "view_families",
]

# The automatic slot size (GPUs, when the user sets no page size) keeps logical pages within this many
# bytes, with slots of at most AUTO_SLOT_MAX: see pool_geometry.
AUTO_PAGE_BYTES = 256 << 20
AUTO_SLOT_MAX = 8 << 20


def _spec_of(kv_cache_config: Any, layer: str) -> Any:
    group = next(g for g in kv_cache_config.kv_cache_groups if layer in g.layer_names)
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    return inner[layer] if inner else spec


def _layout(kv_cache_config: Any, vllm_config: Any) -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    if name is None:
        raise ConfigError("vllm-elastic-kv: the KV cache layout was not resolved before allocation")
    return name if isinstance(name, KVCacheLayout) else KVCacheLayout[str(name)]


def _one_buffer_families(kv_cache_config: Any, vllm_config: Any) -> list[BlockFamily]:
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes, compute_layout_strides

    layout = _layout(kv_cache_config, vllm_config)
    families: list[BlockFamily] = []
    for tensor in kv_cache_config.kv_cache_tensors:
        spec = _spec_of(kv_cache_config, tensor.layers[0])
        num_layers = len(tensor.layers)
        strides = compute_layout_strides(
            spec,
            kv_cache_config.num_blocks,
            num_layers,
            layout,
            fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None),
        )
        shape = (num_layers, *compute_layer_kv_cache_shape_bytes(spec, kv_cache_config.num_blocks))
        axes = [(shape[i], strides[i]) for i in (0, 2, 3, 4)]
        families += strided_families(0, tensor.offset, strides[1], axes)
    return families


def _per_tensor_families(kv_cache_config: Any, split_kv: bool) -> list[BlockFamily]:
    families: list[BlockFamily] = []
    for space, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        if getattr(tensor, "block_stride", 0):
            raise ConfigError(
                "vllm-elastic-kv does not support vLLM 0.26-0.28's packed KV layout (hybrid models); "
                "use --kv-cache-backend=native"
            )
        page = tensor.size // kv_cache_config.num_blocks
        if split_kv:  # (2, num_blocks, ...): K blocks in the first half, V blocks in the second
            half = page // 2
            families += [BlockFamily(space, 0, half, half), BlockFamily(space, tensor.size // 2, half, half)]
        else:
            families.append(BlockFamily(space, 0, page, page))
    return families


def planned_geometry(
    kv_cache_config: Any,
    vllm_config: Any,
    kv_allocation: str,
    page_size: int,
    max_page_slots: int,
    split_kv: bool = False,
) -> BlockGeometry:
    """The pool's geometry from the ``KVCacheConfig`` (see the module docstring).

    ``kv_allocation`` is the compat entry's (``"one_buffer"`` or ``"per_tensor"``); ``split_kv`` applies to
    ``"per_tensor"`` only. Space ``i`` holds the ``i``-th allocation of :func:`planned_allocations`; the
    geometry's ``space_sizes`` are what the worker reserves for them (:func:`planned_spaces`). ConfigError
    when the layout cannot be served with ``page_size``.
    """
    sizes = planned_allocations(kv_cache_config, kv_allocation)
    if kv_allocation == "one_buffer":
        families = _one_buffer_families(kv_cache_config, vllm_config)
    else:
        families = _per_tensor_families(kv_cache_config, split_kv)
    return BlockGeometry(
        sizes, families, kv_cache_config.num_blocks, page_size, max_page_slots=max_page_slots
    )


def planned_spaces(
    geometry: BlockGeometry, kv_cache_config: Any, kv_allocation: str
) -> list[tuple[int, int]]:
    """``(allocation bytes, space bytes)`` for each KV cache ``torch.zeros`` call vLLM makes, in the order of
    the plan's spaces: the worker serves an allocation of ``allocation bytes`` from a space of ``space
    bytes``, the plan's ``space_sizes`` entry.

    A space is larger than its allocation rounded up to a slot whenever a page's extents run past the
    buffer: pages hold ``blocks_per_page`` blocks and the data plane backs every page with the same
    extents, so when ``num_blocks`` is not a multiple of ``blocks_per_page`` the last page's extent of each
    layer covers the room of the blocks it lacks. In a layer-outer buffer that room is the next layer's
    first blocks, and past the last layer it is beyond the buffer (3 layers of 128 KiB blocks, 682 blocks,
    16 blocks a page: the last page of layer 2 ends 512 KiB beyond the 256 MiB the buffer rounds up to).
    Those bytes hold none of the page's blocks; the extra address space costs nothing until a page that
    touches it is backed, and the ledger charges exactly the slots the data plane backs.
    """
    allocations = planned_allocations(kv_cache_config, kv_allocation)
    if len(allocations) != len(geometry.space_sizes):
        raise ConfigError(
            f"vllm-elastic-kv: the plan has {len(geometry.space_sizes)} space(s) for "
            f"{len(allocations)} KV cache allocation(s)"
        )
    return list(zip(allocations, geometry.space_sizes, strict=True))


def pool_geometry(
    kv_cache_config: Any,
    vllm_config: Any,
    kv_allocation: str,
    elastic: ElasticConfig,
    *,
    auto_page_size: bool,
    split_kv: bool = False,
) -> BlockGeometry:
    """The pool's planned geometry, with its slot size (``page_size``): the configured one, or with
    ``auto_page_size`` the largest power-of-two multiple of it, up to ``AUTO_SLOT_MAX``, that keeps a
    logical page (one slot in every space or layer family) within ``AUTO_PAGE_BYTES``.

    Why: the driver's cost is per physical handle, not per byte (backing a 2 MiB and a 32 MiB slot cost
    about the same), so a burst's growth costs the data plane time in proportion to the number of slots,
    and with 2 MiB slots a small model's prefill on a GPU outruns the background maps. A logical page is
    also the least an idle pool holds (the null block's page), so pages stay within 256 MiB, and slots
    within 8 MiB (the largest size run end to end): up to 32 layers get 8 MiB slots, 64 layers 4 MiB,
    80 layers keep 2 MiB. The scheduler and every worker compute the same plan.
    """

    def plan(page_size: int) -> BlockGeometry:
        return planned_geometry(
            kv_cache_config, vllm_config, kv_allocation, page_size, elastic.max_page_slots, split_kv
        )

    configured = plan(elastic.page_size)
    if not auto_page_size:
        return configured
    slots = max(1, round(configured.page_bytes / configured.page_size))
    slot = configured.page_size
    while slot * 2 <= AUTO_SLOT_MAX and slots * slot * 2 <= AUTO_PAGE_BYTES:
        slot *= 2
    return configured if slot == configured.page_size else plan(slot)


def reserve_min_pages(
    plugin: PluginConfig, vllm_config: Any, kv_cache_config: Any, geometry: BlockGeometry, *, gpu: bool
) -> int:
    """The pool's minimum reserve, the empty pages it keeps backed even while idle: the user's
    ``reserve_min_pages`` (``ELASTIC_KV_RESERVE_MIN``) if set, or off GPUs; on GPUs by default the pages one
    scheduler step can fill (``max_num_batched_tokens`` new tokens in every KV cache group), within
    ``[1, reserve_max_pages]``. The scheduler uses it (the ledger's reserve, and what an idle pool keeps).

    Why: a page costs a GPU rank milliseconds of driver calls (one handle per layer), and a burst from
    idle opens with a prefill step of up to ``max_num_batched_tokens`` tokens; with one page kept while
    idle that step waits for background maps. Keeping the step's pages lets it start without a driver
    call, at the price of idle memory (2 GiB for Llama-3-8B's shape; ``docs/results.md``). The host
    backend maps a page in microseconds, so CPUs keep the configured minimum.
    """
    elastic = plugin.elastic
    if not gpu or "reserve_min_pages" in plugin.chosen:
        return elastic.reserve_min_pages
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    blocks = sum(-(-tokens // group.kv_cache_spec.block_size) for group in kv_cache_config.kv_cache_groups)
    return max(1, min(-(-blocks // geometry.blocks_per_page), elastic.reserve_max_pages))


def _block_axis(view: torch.Tensor, num_blocks: int, kv_allocation: str) -> int:
    """The dimension of a per-layer KV view that indexes blocks.

    vLLM >= 0.29 views every layer as ``[B, H, N, C]`` (``create_kv_cache_views``): dimension 0, of size
    ``num_blocks`` times the kernel blocks per block. In 0.26-0.28 the attention backend shapes the view;
    every backend puts the block axis first or second (``(num_blocks, 2, ...)``, ``(2, num_blocks, ...)``).
    """
    if kv_allocation == "one_buffer":
        if view.shape[0] % num_blocks:
            raise ConfigError(
                f"vllm-elastic-kv: KV view {tuple(view.shape)} does not start with {num_blocks} blocks"
            )
        return 0
    candidates = [d for d in (0, 1) if d < view.dim() and view.shape[d] == num_blocks]
    if len(candidates) != 1:
        raise ConfigError(
            f"vllm-elastic-kv cannot tell the block axis of the KV cache view {tuple(view.shape)} "
            f"({num_blocks} blocks): this attention backend's layout is not supported"
        )
    return candidates[0]


def view_families(
    view: torch.Tensor, space: int, space_base: int, num_blocks: int, kv_allocation: str = "one_buffer"
) -> list[BlockFamily]:
    """The bytes each block owns in ``view`` (a per-layer KV cache tensor over space ``space``).

    A block axis of size ``num_blocks * r`` (``r > 1`` when vLLM splits a block into ``r`` kernel blocks)
    counts ``r`` consecutive kernel blocks as one block.
    """
    es = view.element_size()
    dim = _block_axis(view, num_blocks, kv_allocation)
    ratio = view.shape[dim] // num_blocks
    axes = [(n, s * es) for d, (n, s) in enumerate(zip(view.shape, view.stride(), strict=True)) if d != dim]
    axes.append((ratio, view.stride(dim) * es))
    axes.append((es, 1))
    offset = view.data_ptr() - space_base
    return strided_families(space, offset, view.stride(dim) * es * ratio, axes)


def observed_geometry(
    views: Sequence[torch.Tensor],
    space_bases: Sequence[int],
    space_sizes: Sequence[int],
    num_blocks: int,
    page_size: int,
    blocks_per_page: int,
    kv_allocation: str = "one_buffer",
) -> BlockGeometry:
    """The geometry of the tensors vLLM bound to its attention layers (``views``; layers that share a
    cache may repeat a view), over spaces starting at ``space_bases``."""
    families: list[BlockFamily] = []
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for view in views:
        key = (view.data_ptr(), tuple(view.shape), tuple(view.stride()))
        if key in seen:
            continue
        seen.add(key)
        ptr = view.data_ptr()
        space = next(
            (i for i, (b, n) in enumerate(zip(space_bases, space_sizes, strict=True)) if b <= ptr < b + n),
            None,
        )
        if space is None:
            raise ConfigError(
                "vllm-elastic-kv: an attention layer's KV cache is not inside the elastic KV space "
                "(vLLM allocated it some other way)"
            )
        families += view_families(view, space, space_bases[space], num_blocks, kv_allocation)
    return BlockGeometry(space_sizes, families, num_blocks, page_size, blocks_per_page=blocks_per_page)


def check_spaces(observed: BlockGeometry, reserved: Sequence[int]) -> None:
    """ConfigError unless every byte a page of ``observed`` touches lies inside the spaces as reserved
    (``reserved[i]`` bytes for space ``i``): the data plane refuses extents that end beyond a space."""
    if tuple(observed.space_sizes) != tuple(reserved):
        raise ConfigError(
            "vllm-elastic-kv: the pages of the KV cache vLLM bound need spaces of "
            f"{list(observed.space_sizes)} bytes, the worker reserved {list(reserved)} "
            f"({observed.describe()})"
        )


def check_plan(planned: BlockGeometry, observed: BlockGeometry) -> None:
    """ConfigError when the scheduler's plan and the worker's real layout disagree on pages or their cost."""
    if (planned.num_pages, planned.blocks_per_page) != (observed.num_pages, observed.blocks_per_page):
        raise ConfigError(
            f"vllm-elastic-kv: scheduler and worker disagree on pages ({planned.describe()} vs "
            f"{observed.describe()})"
        )
    if not math.isclose(planned.page_bytes, observed.page_bytes, rel_tol=0.0):
        raise ConfigError(
            "vllm-elastic-kv: the attention backend lays the KV cache out differently from the plan "
            f"(plan: {planned.describe()}; backend: {observed.describe()}); this backend is not supported"
        )
