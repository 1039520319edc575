"""The elastic pools, allocators and hooks against SGLang's real classes, in-process, on the host backend
(no engine: plain ``device="cpu"`` SGLang objects, the real ledger and data plane)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from elastic_kv.errors import ConfigError

from tests.support.sglang_units import configurator

pytestmark = pytest.mark.sglang


H, D, LAYERS = 2, 32, 2
ROW = H * D * 4  # bytes of one token's K (or V) row in one layer


@pytest.fixture
def env(plugin_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The plugin's unit-test environment (conftest ``plugin_env``)."""
    return plugin_env


def _pools(size: int, page_size: int) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    native = MHATokenToKVPool(size, page_size, torch.float32, H, D, LAYERS, "cpu", False)
    elastic = ElasticMHATokenToKVPool(size, page_size, torch.float32, H, D, LAYERS, "cpu", False)
    return native, elastic


def _backed(pool: Any, slots: torch.Tensor) -> bool:
    """Whether every page holding one of ``slots`` is mapped (K and V of every layer)."""
    ledger = pool.elastic.ledger
    blocks = {int(s) // pool.rows_per_block for s in slots}
    return all(ledger.page_state(pool.elastic.geometry.page_of(b)) == "used" for b in blocks)


@pytest.fixture
def token_setup(env: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator

    env.setenv("ELASTIC_KV_SGLANG_TOKEN_CHUNK", "64")
    _, pool = _pools(4096, 1)
    alloc = ElasticTokenToKVPoolAllocator(4096, torch.float32, "cpu", pool, False)
    yield pool, alloc
    pool.elastic.close()


@pytest.fixture
def paged_setup(env: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator

    _, pool = _pools(4096, 16)
    alloc = ElasticPagedTokenToKVPoolAllocator(4096, 16, torch.float32, "cpu", pool, False)
    yield pool, alloc
    pool.elastic.close()


# -- pools ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_mha_buffers_have_sglangs_shapes_and_strides(env: pytest.MonkeyPatch, page_size: int) -> None:
    native, elastic = _pools(4096, page_size)
    for kind in ("k_buffer", "v_buffer"):
        for a, b in zip(getattr(native, kind), getattr(elastic, kind), strict=True):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    # K and V are halves of one allocation per layer, at the same distance as SGLang's.
    for layer in range(LAYERS):
        native_gap = native.v_buffer[layer].data_ptr() - native.k_buffer[layer].data_ptr()
        assert elastic.v_buffer[layer].data_ptr() - elastic.k_buffer[layer].data_ptr() == native_gap
    assert elastic.get_kv_size_bytes() == native.get_kv_size_bytes()
    assert [d.shape for d in elastic._kv_buffer_descs] == [d.shape for d in native._kv_buffer_descs]
    elastic.elastic.close()


def test_mha_refuses_post_capture_sizing(env: pytest.MonkeyPatch) -> None:
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool

    with pytest.raises(ConfigError, match="post-capture"):
        ElasticMHATokenToKVPool(4096, 16, torch.float32, H, D, LAYERS, "cpu", False, post_capture_active=True)


def test_mla_pool_over_elastic_spaces(env: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator
    from sglang_elastic_kv.pool import ElasticMLATokenToKVPool

    native = MLATokenToKVPool(2048, 16, torch.float32, 64, 32, LAYERS, "cpu", False)
    pool = ElasticMLATokenToKVPool(2048, 16, torch.float32, 64, 32, LAYERS, "cpu", False)
    assert [(b.shape, b.stride()) for b in pool.kv_buffer] == [
        (b.shape, b.stride()) for b in native.kv_buffer
    ]
    alloc = ElasticPagedTokenToKVPoolAllocator(2048, 16, torch.float32, "cpu", pool, False)
    slots = alloc.alloc(32)
    assert slots is not None and _backed(pool, slots)
    pool.kv_buffer[1][slots] = 3.0
    assert bool((pool.kv_buffer[1][slots] == 3.0).all())
    pool.elastic.close()


def test_kv_written_through_sglang_is_read_back(token_setup: tuple[Any, Any]) -> None:
    pool, alloc = token_setup
    slots = alloc.alloc(300)
    k = torch.randn(300, H, D)
    v = torch.randn(300, H, D)

    class Layer:
        layer_id = 1

    pool.set_kv_buffer(Layer(), slots, k, v)
    got_k, got_v = pool.get_kv_buffer(1)
    assert torch.equal(got_k[slots], k) and torch.equal(got_v[slots], v)


# -- token allocator (page_size 1) -----------------------------------------------------------------------


def test_token_alloc_returns_backed_slots_never_slot_0(token_setup: tuple[Any, Any]) -> None:
    pool, alloc = token_setup
    assert alloc.available_size() == 4096
    slots = alloc.alloc(1000)
    assert slots is not None and len(slots) == 1000 and len(set(slots.tolist())) == 1000
    assert 0 not in slots.tolist() and int(slots.max()) <= 4096
    assert _backed(pool, slots)
    assert alloc.available_size() == 4096 - 1000
    assert pool.elastic.ledger.page_state(0) == "used"  # the padding slot's page


def test_token_free_returns_chunks_and_clear_returns_everything(token_setup: tuple[Any, Any]) -> None:
    pool, alloc = token_setup
    ledger = pool.elastic.ledger
    slots = alloc.alloc(2000)
    grown = ledger.charged_bytes
    assert ledger.used_blocks >= 2000 // 64
    alloc.free_group_begin()
    alloc.free(slots[:1000])
    alloc.free(slots[1000:])
    assert ledger.used_blocks >= 2000 // 64  # held until the group ends, as SGLang's own frees
    alloc.free_group_end()
    assert ledger.used_blocks == 0 and alloc.available_size() == 4096
    assert ledger.charged_bytes < grown
    assert alloc.verify_byte_accounting() == []
    alloc.alloc(500)
    alloc.clear()
    snap = ledger.snapshot()
    assert snap.used_blocks == 0 and snap.mapped_pages == 1  # the null page only
    assert alloc.available_size() == 4096


def _pool_under_limit(env: pytest.MonkeyPatch, page_size: int, pages: int) -> tuple[Any, int]:
    """A pool of 4096 slots at ``page_size`` whose limit is ``pages`` data-plane pages, and the page's bytes
    (read from a probe pool, closed before)."""
    _, probe = _pools(4096, page_size)
    page_bytes = probe.elastic.geometry.page_bytes
    probe.elastic.close()
    env.setenv("ELASTIC_KV_LIMIT", str(pages * page_bytes))
    return _pools(4096, page_size)[1], page_bytes


def test_token_alloc_under_a_limit(env: pytest.MonkeyPatch) -> None:
    from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator

    env.setenv("ELASTIC_KV_SGLANG_TOKEN_CHUNK", "64")
    pool, page_bytes = _pool_under_limit(env, 1, 3)
    alloc = ElasticTokenToKVPoolAllocator(4096, torch.float32, "cpu", pool, False)
    # Logical capacity is unchanged (SGLang's idle check counts on it); what can be backed is not.
    assert alloc.available_size() == 4096
    backable = alloc.elastic_available_size()
    assert 0 < backable < 4096
    assert alloc.alloc(4000) is None
    assert alloc.available_size() == 4096 and pool.elastic.ledger.used_blocks == 0  # nothing taken
    first = alloc.alloc(backable)  # the headroom is a promise (it may be conservative, never optimistic)
    assert first is not None
    held = [first]
    while (more := alloc.alloc(64)) is not None:
        held.append(more)
    assert pool.elastic.ledger.charged_bytes <= 3 * page_bytes
    assert (
        alloc.check_decode_capacity(num_tokens=alloc.elastic_available_size() + 1, tree_cache=None) is False
    )
    alloc.free(torch.cat(held))
    assert alloc.check_decode_capacity(num_tokens=backable, tree_cache=None) is True
    pool.elastic.close()


def test_verify_byte_accounting_reports_a_mismatch(token_setup: tuple[Any, Any]) -> None:
    pool, alloc = token_setup
    alloc.alloc(200)
    extra = pool.elastic.ledger.alloc(1)  # a block the allocator does not know about
    assert extra is not None
    violations = alloc.verify_byte_accounting()
    assert violations and "live blocks" in violations[0]


# -- paged allocator (page_size 16) ----------------------------------------------------------------------


def test_paged_extend_and_decode_use_ledger_pages(paged_setup: tuple[Any, Any]) -> None:
    pool, alloc = paged_setup
    ledger = pool.elastic.ledger
    prefix = torch.tensor([0, 0])
    seq = torch.tensor([20, 40])
    out = alloc.alloc_extend(prefix, prefix, seq, seq, torch.tensor([-1, -1]), 60)
    assert out is not None and len(out) == 60 and _backed(pool, out)
    pages = {int(s) // 16 for s in out.tolist()}
    assert 0 not in pages and ledger.used_blocks == len(pages) == 5
    last = torch.tensor([int(out[19]), int(out[59])])
    dec = alloc.alloc_decode(seq + 1, seq + 1, last)
    assert dec is not None and dec.tolist() == [int(out[19]) + 1, int(out[59]) + 1]  # same pages
    assert alloc.available_size() == 4096 - 5 * 16
    alloc.free_group_begin()
    alloc.free(torch.cat([out, dec]))
    alloc.free_group_end()
    assert ledger.used_blocks == 0 and alloc.available_size() == 4096
    assert alloc.verify_byte_accounting() == []


def test_paged_alloc_fails_cleanly_when_the_ledger_cannot_back(env: pytest.MonkeyPatch) -> None:
    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator

    pool, _ = _pool_under_limit(env, 16, 2)
    alloc = ElasticPagedTokenToKVPoolAllocator(4096, 16, torch.float32, "cpu", pool, False)
    room = alloc.elastic_available_size()
    assert 0 < room < 4096
    assert alloc.alloc(room + 16) is None
    assert pool.elastic.ledger.used_blocks == 0 and alloc.available_size() == 4096
    assert alloc.alloc(room) is not None
    pool.elastic.close()


# -- radix cache and prefill budget -----------------------------------------------------------------------


def _radix(alloc: Any, page_size: int) -> Any:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size
        )
    )


def _insert(cache: Any, alloc: Any, first: int, n: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    value = alloc.alloc(n)
    assert value is not None
    cache.insert(InsertParams(key=RadixKey(token_ids=array("q", range(first, first + n))), value=value))


def test_eviction_follows_physical_headroom(env: pytest.MonkeyPatch) -> None:
    """Logical room is plentiful; backable room is not: evict_to_free_tokens evicts for the latter."""
    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator

    pool, _ = _pool_under_limit(env, 16, 3)
    alloc = ElasticPagedTokenToKVPoolAllocator(4096, 16, torch.float32, "cpu", pool, False)
    cache = _radix(alloc, 16)
    _insert(cache, alloc, 1000, 256)
    _insert(cache, alloc, 3000, 256)
    assert cache.evictable_size() == 512
    need = alloc.elastic_available_size() + 128
    assert alloc.available_size() >= need  # SGLang's own check would not evict anything
    assert alloc.check_decode_capacity(num_tokens=need, tree_cache=cache) is True
    assert cache.evictable_size() < 512
    step = alloc.alloc(need)  # the decode step the check admitted takes what it backed, and ends
    assert step is not None
    alloc.free(step)
    budget = alloc.create_prefill_budget(cache)
    assert budget.remaining_total == alloc.elastic_available_size() + cache.evictable_size()
    pool.elastic.close()


def test_radix_bound_evicts_the_excess(paged_setup: tuple[Any, Any]) -> None:
    from sglang_elastic_kv.hooks import release_kv_cache_after

    pool, alloc = paged_setup
    cache = _radix(alloc, 16)
    for i in range(6):
        _insert(cache, alloc, 100 * i, 64)
    assert cache.evictable_size() == 384
    release_kv_cache_after(0, None, None, cache)  # no bound, within the limit: the cache keeps everything
    assert cache.evictable_size() == 384
    release_kv_cache_after(128, None, None, cache)
    assert cache.evictable_size() <= 128
    assert pool.elastic.ledger.used_blocks == cache.evictable_size() // 16


def test_radix_cache_yields_everything_while_the_pool_is_over_its_limit(paged_setup: tuple[Any, Any]) -> None:
    """kvctl lowered the limit below what the cache keeps backed: after the next release the cache gives
    back every evictable entry (bound or not), so the pool can come back within the limit."""
    from sglang_elastic_kv.hooks import release_kv_cache_after

    pool, alloc = paged_setup
    ledger = pool.elastic.ledger
    cache = _radix(alloc, 16)
    for i in range(6):
        _insert(cache, alloc, 100 * i, 64)
    ledger.resize(ledger.charged_bytes - 1)  # one byte below what the cached entries keep backed
    assert alloc.elastic_over_limit()
    release_kv_cache_after(1024, None, None, cache)
    assert cache.evictable_size() == 0 and ledger.used_blocks == 0
    ledger.release_through(ledger.epoch)
    assert not alloc.elastic_over_limit()


def test_retracted_requests_prefixes_are_evicted_while_the_pool_is_over_its_limit(
    paged_setup: tuple[Any, Any],
) -> None:
    """After SGLang retracted requests of a shrinking pool, the prefixes they unlocked are evicted at once
    (a retracted request admitted again would otherwise match them on the pages being released), and the
    retractions are counted in the pool's snapshot."""
    from types import SimpleNamespace

    from sglang_elastic_kv.hooks import retract_decode_after

    pool, alloc = paged_setup
    ledger = pool.elastic.ledger
    cache = _radix(alloc, 16)
    for i in range(4):
        _insert(cache, alloc, 100 * i, 64)
    batch = SimpleNamespace(token_to_kv_pool_allocator=alloc, tree_cache=cache)
    retract_decode_after((["r1", "r2"], 0.5, []), batch)  # within the limit: the cache keeps its entries
    assert cache.evictable_size() == 256 and ledger.preemptions == 2
    ledger.resize(ledger.charged_bytes - 1)
    retract_decode_after((["r3"], 0.5, []), batch)
    assert cache.evictable_size() == 0 and ledger.used_blocks == 0 and ledger.preemptions == 3


# -- hooks ------------------------------------------------------------------------------------------------


def test_platform_hooks_answer_elastic_classes_only_where_the_platform_has_none() -> None:
    from sglang.srt.platforms.cpu import CpuSRTPlatform
    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator
    from sglang_elastic_kv.hooks import kv_pool_cls_after, paged_allocator_cls_after
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool, ElasticMLATokenToKVPool

    platform = CpuSRTPlatform()
    assert kv_pool_cls_after(None, platform, kind="mha") is ElasticMHATokenToKVPool
    assert kv_pool_cls_after(None, platform, kind="mla") is ElasticMLATokenToKVPool
    assert kv_pool_cls_after(None, platform, kind="dsa") is None
    assert paged_allocator_cls_after(None, platform) is ElasticPagedTokenToKVPoolAllocator
    with pytest.raises(ConfigError, match="supplies its own mha KV pool"):
        kv_pool_cls_after(dict, platform, kind="mha")


def test_allocator_builder_swaps_page_size_1_and_refuses_the_rest(token_setup: tuple[Any, Any]) -> None:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator
    from sglang_elastic_kv.hooks import build_allocator_around

    pool, _ = token_setup
    built = build_allocator_around(
        lambda cfg, **kw: TokenToKVPoolAllocator(512, torch.float32, "cpu", pool, False),
        configurator(),
        token_to_kv_pool_allocator=None,
    )
    assert type(built) is ElasticTokenToKVPoolAllocator and built.get_kvcache() is pool
    plain = MHATokenToKVPool(512, 1, torch.float32, H, D, LAYERS, "cpu", False)
    with pytest.raises(ConfigError, match="elastic KV pool"):
        build_allocator_around(
            lambda cfg, **kw: TokenToKVPoolAllocator(512, torch.float32, "cpu", plain, False),
            configurator(),
            token_to_kv_pool_allocator=None,
        )


def test_speculative_decoding_is_refused_before_anything_is_built() -> None:
    from sglang_elastic_kv.hooks import build_allocator_around

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the allocator was built")

    from types import SimpleNamespace

    from sglang_elastic_kv.hooks import refuse_unserved_before

    for name in ("NGRAM", "EAGLE", "STANDALONE"):
        with pytest.raises(ConfigError) as info:
            build_allocator_around(never, configurator(name), token_to_kv_pool_allocator=None)
        text = str(info.value)
        assert "\n" not in text and f"speculative decoding (--speculative-algorithm {name})" in text
        with pytest.raises(ConfigError, match=f"--speculative-algorithm {name}"):
            refuse_unserved_before(object(), SimpleNamespace(speculative_algorithm=name))
    refuse_unserved_before(object(), SimpleNamespace(speculative_algorithm=None))  # no speculation: served


def test_configured_cache_must_be_elastic(token_setup: tuple[Any, Any]) -> None:
    """The configurator's result is checked: a native allocator (a path that bypassed the seams) or the
    page-major layout fails start-up. The configurator here is a stand-in: building SGLang's needs a model."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang_elastic_kv.hooks import verify_configured_after

    pool, alloc = token_setup
    plain_cfg = SimpleNamespace(_page_major_enabled=lambda: False, mambaish_config=None)
    verify_configured_after(SimpleNamespace(token_to_kv_pool_allocator=alloc), plain_cfg)
    native = TokenToKVPoolAllocator(512, torch.float32, "cpu", pool, False)
    with pytest.raises(ConfigError, match="without the platform seams"):
        verify_configured_after(SimpleNamespace(token_to_kv_pool_allocator=native), plain_cfg)
    with pytest.raises(ConfigError, match="page-major"):
        verify_configured_after(
            SimpleNamespace(token_to_kv_pool_allocator=alloc),
            SimpleNamespace(_page_major_enabled=lambda: True, mambaish_config=None),
        )
