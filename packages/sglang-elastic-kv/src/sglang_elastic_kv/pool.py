"""SGLang KV pools whose buffers live in elastic spaces: same shapes, same strides, same kernels.

``ElasticMHATokenToKVPool`` and ``ElasticMLATokenToKVPool`` subclass SGLang's own pools (never replace
them: siblings such as ``PageMajorMHATokenToKVPool`` must keep passing ``isinstance`` checks) and change
only where the buffer storage comes from, which is the seam SGLang's ``get_kv_pool_cls`` documents:

* MHA, NHD layout, K and V of equal shape: SGLang allocates each layer as one ``(2, padded, H, D)``
  tensor and uses its halves as ``k_buffer[l]`` / ``v_buffer[l]``; here that allocation is one
  elastic space per layer, and a block owns its rows in *both* halves (two block families), so
  backing a block backs its K and its V. K and V of different shapes get one space each.
* MLA: one ``(rows, 1, kv_cache_dim)`` buffer per layer, one space each.

A *block* is the unit the ledger hands out: an SGLang page when ``page_size > 1`` (block id = page
id), and a chunk of ``ELASTIC_KV_SGLANG_TOKEN_CHUNK`` token slots when ``page_size == 1`` (see
:mod:`sglang_elastic_kv.allocator`). Block 0 holds the padding slot/page 0 that SGLang writes dummy
tokens to; the ledger keeps it backed for the pool's lifetime.

Configurations whose storage SGLang carves differently (quantized KV, post-capture VMM sizing, HND or
AITER 5-D layouts, the torch memory saver, a custom NVLink mem pool) are refused with ConfigError at
start-up rather than served natively behind the user's back.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from elastic_kv.errors import ConfigError
from elastic_kv.geometry import BlockFamily
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from sglang_elastic_kv import compat
from sglang_elastic_kv.backing import BufferSpec, ElasticBacking
from sglang_elastic_kv.config import PluginConfig

__all__ = ["ElasticKVPool", "ElasticMHATokenToKVPool", "ElasticMLATokenToKVPool"]

logger = logging.getLogger(__name__)


class ElasticKVPool:
    """Mixin: what the elastic allocators need from an elastic pool (``elastic`` and ``rows_per_block``)."""

    elastic: ElasticBacking | None = None
    plugin_config: PluginConfig | None = None
    allocation_label: str | None  # set by SGLang's KVCache constructor
    device: str  # likewise
    memory_saver_adapter: Any  # likewise (``--enable-memory-saver``)
    # Token slots one ledger block covers (the page size, or the token chunk at page_size 1).
    rows_per_block: int = 0
    # The in-tree method that carves this pool's buffers (the seam overridden below), for error messages.
    _carving_method: str = ""

    # A sub-pool of no layers (the full-attention side of an all-sliding model) holds no memory at all:
    # SGLang builds its empty buffer lists and no elastic storage is reserved.
    no_layers: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.elastic is None and not self.no_layers:
            # SGLang built the buffers without calling the method we override: its carving moved.
            raise ConfigError(
                f"SGLang did not build the KV buffers through {self._carving_method}; "
                "this sglang version is not supported by --kv-cache-backend=elastic"
            )

    def _elastic_setup(self, size: int, page_size: int) -> tuple[PluginConfig, int, int]:
        """Read the plugin config once and decide the block size; returns (config, rows, rows_per_block)."""
        config = PluginConfig.from_env(os.environ)
        self.plugin_config = config
        rows = size + page_size
        rows_per_block = page_size if page_size > 1 else config.token_chunk
        self.rows_per_block = rows_per_block
        return config, rows, rows_per_block

    def _back(
        self,
        config: PluginConfig,
        buffers: list[BufferSpec],
        families: list[BlockFamily],
        num_blocks: int,
        label: str,
    ) -> ElasticBacking:
        """The pool's elastic backing over ``buffers`` (one space each), labelled for the registry."""
        return ElasticBacking.create(
            device=self.device,
            buffers=buffers,
            families=families,
            num_blocks=num_blocks,
            config=config,
            label=label,
            part=self._part(),
        )

    def _part(self) -> str | None:
        # SGLang labels the sub-pools of a composite ("Full" / "SWA" in SWAKVPool); a standalone pool has
        # no label. The label tells the registry records of one engine's pools apart.
        label = self.allocation_label
        return str(label).lower() if label else None

    def _refuse_unless_plain(
        self, *, what: str, custom_mem_pool: bool, checks: dict[str, bool] | None = None
    ) -> None:
        """ConfigError naming every feature this pool cannot serve that is on: ``checks`` (description ->
        on), then the memory saver and ``custom_mem_pool`` (a custom NVLink memory pool), which no elastic
        pool serves."""
        checks = {
            **(checks or {}),
            "--enable-memory-saver": self.memory_saver_adapter.enabled,
            "a custom NVLink memory pool": custom_mem_pool,
        }
        bad = [name for name, present in checks.items() if present]
        if bad:
            raise ConfigError(
                f"--kv-cache-backend=elastic cannot serve this {what}: {', '.join(bad)}. "
                "Use --kv-cache-backend=native for this configuration."
            )


class ElasticMHATokenToKVPool(ElasticKVPool, MHATokenToKVPool):
    """``MHATokenToKVPool`` over elastic spaces; constructed by SGLang with the in-tree arguments."""

    _carving_method = "MHATokenToKVPool._create_buffers_normal"

    def _create_buffers(self) -> None:
        compat.check_instance(self, "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool")
        self._refuse_unless_plain(
            what="MHA KV pool",
            custom_mem_pool=bool(self.enable_custom_mem_pool),
            checks={
                "a quantized KV cache": self.is_quantized_kv_cache,
                "post-capture KV sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING)": self.post_capture_active,
                f"the {self.kv_cache_layout!r} layout (only 'nhd')": self.kv_cache_layout != "nhd",
            },
        )
        super()._create_buffers()

    def _create_buffers_normal(self) -> None:
        if self.layer_num == 0:
            self.no_layers = True
            super()._create_buffers_normal()  # empty K and V lists
            return
        config, rows, rpb = self._elastic_setup(self.size, self.page_size)
        k_shape, v_shape = self._kv_buffer_shapes()
        item = self.store_dtype.itemsize
        k_row = item * int(torch.Size(k_shape[1:]).numel())
        v_row = item * int(torch.Size(v_shape[1:]).numel())
        num_blocks = -(-rows // rpb)
        # Rows past ``rows`` in the last block are never handed out; the space only has to contain them.
        block_rows = num_blocks * rpb
        buffers: list[BufferSpec] = []
        families: list[BlockFamily] = []
        if k_shape == v_shape:
            # SGLang's layout: one allocation per layer, K and V as block-aligned halves (padded rows).
            padded = -(-rows // self.page_size) * self.page_size
            for layer in range(self.layer_num):
                space = len(buffers)
                buffers.append(BufferSpec(f"kv{layer}", padded * k_row + block_rows * k_row))
                families.append(BlockFamily(space, 0, rpb * k_row, rpb * k_row))
                families.append(BlockFamily(space, padded * k_row, rpb * k_row, rpb * k_row))
        else:
            for layer in range(self.layer_num):
                buffers.append(BufferSpec(f"k{layer}", block_rows * k_row))
                families.append(BlockFamily(len(buffers) - 1, 0, rpb * k_row, rpb * k_row))
                buffers.append(BufferSpec(f"v{layer}", block_rows * v_row))
                families.append(BlockFamily(len(buffers) - 1, 0, rpb * v_row, rpb * v_row))
        self.elastic = self._back(config, buffers, families, num_blocks, f"mha-{self.layer_num}l")
        if k_shape == v_shape:
            padded = -(-rows // self.page_size) * self.page_size
            fused = [
                self.elastic.view(layer, 0, (2, padded, *k_shape[1:]), self.store_dtype)
                for layer in range(self.layer_num)
            ]
            self.k_buffer = [buf[0, :rows] for buf in fused]
            self.v_buffer = [buf[1, :rows] for buf in fused]
        else:
            self.k_buffer = [
                self.elastic.view(2 * i, 0, k_shape, self.store_dtype) for i in range(self.layer_num)
            ]
            self.v_buffer = [
                self.elastic.view(2 * i + 1, 0, v_shape, self.store_dtype) for i in range(self.layer_num)
            ]
        logger.info("elastic MHA KV pool: %s", self.elastic.describe())


class ElasticMLATokenToKVPool(ElasticKVPool, MLATokenToKVPool):
    """``MLATokenToKVPool`` over elastic spaces (one latent buffer per layer)."""

    _carving_method = "MLATokenToKVPool._create_buffers"

    def _create_buffers(self) -> None:
        compat.check_instance(self, "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool")
        self._refuse_unless_plain(what="MLA KV pool", custom_mem_pool=bool(self.custom_mem_pool))
        config, rows, rpb = self._elastic_setup(self.size, self.page_size)
        item = self.store_dtype.itemsize
        row = item * self.kv_cache_dim
        num_blocks = -(-rows // rpb)
        buffers = [BufferSpec(f"kv{layer}", num_blocks * rpb * row) for layer in range(self.layer_num)]
        families = [BlockFamily(i, 0, rpb * row, rpb * row) for i in range(self.layer_num)]
        self.elastic = self._back(config, buffers, families, num_blocks, f"mla-{self.layer_num}l")
        self.kv_buffer = [
            self.elastic.view(i, 0, (rows, 1, self.kv_cache_dim), self.store_dtype)
            for i in range(self.layer_num)
        ]
        logger.info("elastic MLA KV pool: %s", self.elastic.describe())
