"""Hybrid KV cache groups without an engine: vLLM's hybrid KV cache manager (one full-attention group and two
sliding-window groups, as vLLM builds them for Gemma 2/3 and gpt-oss) over the elastic block pool, the real
ledger and the real data plane (host backend).

vLLM's hybrid allocator gives every group its own block table over one shared ``BlockPool``; the groups'
``KVCacheTensor``\\ s overlay the same bytes, so a block id addresses one block of memory whichever group
holds it, and one ledger page covers a block id in every group. These tests follow one long request
through the window: the sliding-window groups drop the blocks that leave the window
(``remove_skipped_blocks``), and those blocks' pages go back -- at once without prefix caching, and when
trimmed or reused in place with it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch
from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import LocalMapper
from vllm_elastic_kv import compat
from vllm_elastic_kv.features import check_model
from vllm_elastic_kv.layout import planned_geometry
from vllm_elastic_kv.scheduler.block_pool import ElasticBlockPool
from vllm_elastic_kv.scheduler.kv_cache_manager import ElasticKVCacheManager

pytestmark = pytest.mark.vllm

BLOCK = 16  # tokens per block
WINDOW = 2 * BLOCK  # sliding window, tokens
NUM_BLOCKS = 96
PAGE = BLOCK * 2 * 64 * 2 * 2  # one block of one layer: tokens x kv heads x head size x (K, V) x fp16
GROUPS = ("full", "swa0", "swa1")


@dataclasses.dataclass
class Hybrid:
    manager: ElasticKVCacheManager
    pool: ElasticBlockPool
    ledger: Ledger
    group: Any
    hasher: Any
    ids: Any = dataclasses.field(default_factory=itertools.count)

    def request(self, tokens: list[int]) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        return Request(
            f"r{next(self.ids)}", tokens, SamplingParams(max_tokens=256), None, block_hasher=self.hasher
        )

    def blocks(self, req: Any, group: int) -> list[Any]:
        managers = self.manager.coordinator.single_type_managers
        return list(managers[group].req_to_blocks.get(req.request_id, []))

    def held(self, req: Any) -> set[int]:
        """Block ids the request holds in any group (the null block excluded)."""
        return {b.block_id for g in range(len(GROUPS)) for b in self.blocks(req, g) if not b.is_null}

    def step(self, req: Any, tokens: int) -> None:
        """Schedule ``tokens`` new tokens of ``req`` and complete the step (they become computed)."""
        assert self.manager.allocate_slots(req, tokens) is not None
        req.num_computed_tokens += tokens
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output_token_ids(5 + req.num_tokens % 900)


def _kv_cache_config() -> Any:
    """What vLLM 0.32 builds for three layers of one page size and two attention kinds: one group per
    kind-layer, every group's tensor over the same bytes (``get_kv_cache_config_from_groups``)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    swa = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=WINDOW
    )
    assert full.page_size_bytes == swa.page_size_bytes == PAGE
    size = NUM_BLOCKS * PAGE
    groups = [KVCacheGroupSpec([name], full if name == "full" else swa) for name in GROUPS]
    tensors = [
        KVCacheTensor(size=size, layers=[name], layer_stride=size, block_stride=PAGE) for name in GROUPS
    ]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
        hash_block_size=BLOCK,
    )


def _hybrid(*, caching: bool, limit_pages: int = 0) -> Hybrid:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    cfg = _kv_cache_config()
    check_model(cfg)  # the elastic backend serves these groups
    geo = planned_geometry(cfg, None, "one_buffer", PAGE, max_page_slots=8)
    # The groups overlay one another: a page is one block id's bytes, whichever group holds it.
    assert geo.blocks_per_page == 1 and geo.page_bytes == PAGE and geo.num_pages == NUM_BLOCKS
    backend = _vmm.HostBackend()
    space = _vmm.TensorSpace(backend, geo.space_sizes[0], PAGE)
    group = _vmm.SpaceGroup([space], geo.extent_tuples(), geo.num_pages, _vmm.HandlePool(backend, 0))
    elastic = ElasticConfig(
        page_size=PAGE, reserve_min_pages=0, reserve_max_pages=0, premap=False, limit_bytes=limit_pages * PAGE
    )
    ledger = Ledger(geo, LocalMapper(group), elastic, null_block=0)
    with compat.scoped_attribute(
        compat.target("vllm.v1.core.kv_cache_coordinator", "BlockPool"), ElasticBlockPool
    ):
        manager = ElasticKVCacheManager(
            cfg, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=caching
        )
    kinds = [type(m).__name__ for m in manager.coordinator.single_type_managers]
    assert kinds == ["FullAttentionManager", "SlidingWindowManager", "SlidingWindowManager"]
    pool = manager.block_pool
    assert isinstance(pool, ElasticBlockPool)
    pool.attach(ledger)
    init_none_hash(sha256)
    return Hybrid(manager, pool, ledger, group, get_request_block_hasher(BLOCK, sha256))


def _window_blocks(computed: int) -> int:
    """Blocks a sliding-window group holds once a decode step brought the request to ``computed`` tokens:
    the step allocated up to its token, and first dropped the blocks wholly before the window of the
    tokens computed before it (vLLM skips ``computed - sliding_window + 1`` tokens)."""
    before = computed - 1
    return -(-computed // BLOCK) - max(0, before - WINDOW + 1) // BLOCK


def test_window_blocks_return_their_pages_at_once_without_prefix_caching() -> None:
    hy = _hybrid(caching=False)
    req = hy.request(list(range(100, 100 + 8 * BLOCK)))
    hy.step(req, 8 * BLOCK)  # the prefill: 8 blocks in every group, 24 pages
    assert len(hy.held(req)) == 3 * 8 and hy.group.num_mapped == 1 + 24
    for _ in range(3 * BLOCK):  # decode through three more blocks
        hy.step(req, 1)
        computed = req.num_computed_tokens
        full = -(-computed // BLOCK)
        # The sliding-window groups hold only their window; what left it went back to the ledger ...
        assert len(hy.held(req)) == full + 2 * _window_blocks(computed)
        assert hy.ledger.used_blocks == len(hy.held(req))
        # ... and no page stays backed for it: the null page, and one page per held block.
        assert hy.group.num_mapped == 1 + len(hy.held(req))
    hy.manager.free(req)
    assert hy.ledger.used_blocks == 0 and hy.group.num_mapped == 1
    hy.ledger.check_invariants()


def test_window_blocks_stay_cached_with_prefix_caching_and_go_when_trimmed() -> None:
    hy = _hybrid(caching=True)
    req = hy.request(list(range(300, 300 + 8 * BLOCK)))
    hy.step(req, 8 * BLOCK)
    for _ in range(2 * BLOCK):
        hy.step(req, 1)
    held = hy.held(req)
    # Dropped window blocks are whole blocks with prefix-cache entries: vLLM keeps them as evictable cache
    # (a later prompt with this prefix hits them), and their pages stay backed until evicted or trimmed.
    assert hy.pool.num_cached > 0
    assert hy.ledger.used_blocks == len(held) + hy.pool.num_cached
    # Trimming evicts them: each sits on a page of its own with nothing else live.
    cached = hy.pool.num_cached
    assert hy.pool.trim_cached() == cached and hy.pool.num_cached == 0
    assert hy.ledger.used_blocks == len(held) and hy.group.num_mapped == 1 + len(held)
    hy.manager.free(req)
    hy.ledger.check_invariants()


def test_a_long_request_fits_a_limit_only_its_windows_fit() -> None:
    """Under a limit of 20 pages a request of 12 blocks would need 36 without the window (12 per group);
    with it, 12 + 2 x 3 at most. With prefix caching on, dropped blocks are reused in place."""
    hy = _hybrid(caching=True, limit_pages=20)
    req = hy.request(list(range(500, 500 + 4 * BLOCK)))
    hy.step(req, 4 * BLOCK)
    for _ in range(8 * BLOCK):
        hy.step(req, 1)
        assert hy.group.num_mapped <= 20
    assert req.num_computed_tokens == 12 * BLOCK
    hy.manager.free(req)
    hy.ledger.check_invariants()
