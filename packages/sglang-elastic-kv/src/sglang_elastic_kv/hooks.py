"""The memory hooks of an enabled plugin (one ``install`` per process, targets from the compat table).

1. ``SRTPlatform.get_kv_pool_cls`` (AFTER): where the platform has no opinion (every in-tree platform,
   CPU and CUDA included, inherits this method), answer the elastic MHA / MLA pool class. Hooking the
   base class leaves platform selection alone, which a platform plugin (``sglang.srt.platforms``)
   would take over; an out-of-tree platform with its own pool class is refused, not overridden.
2. ``SRTPlatform.get_paged_allocator_cls`` (AFTER): the same for the paged allocator (page_size > 1,
   also inside the SWA allocator).
3. ``KVCacheConfigurator._build_token_to_kv_pool_allocator`` (AROUND): page_size 1 builds
   ``TokenToKVPoolAllocator`` without asking the platform, and no platform seam names the hybrid SWA
   allocator; the plain allocator SGLang built is swapped for the elastic one over the same pool
   (``SWATokenToKVPoolAllocator`` for
   :class:`~sglang_elastic_kv.allocator.swa.ElasticSWATokenToKVPoolAllocator`, built with the same arguments,
   whose sub-allocators are elastic at every page size). Then the result is checked: an allocator kind the
   plugin does not serve (HiSparse, page interleave, DeepSeek-V4 ...) or a non-elastic pool under it fails
   start-up with ConfigError. The all-sliding ``PureSWATokenToKVPoolAllocator`` becomes
   :class:`~sglang_elastic_kv.allocator.pure_swa.ElasticPureSWAAllocator`.
   Over a Mamba / linear hybrid's ``HybridLinearKVPool`` the allocator backs its elastic full-attention
   pool. Speculative decoding (any ``--speculative-algorithm``) is refused here (:func:`refuse_speculative`)
   and already by a BEFORE hook on ``Scheduler.__init__`` (:func:`refuse_unserved_before`), since SGLang
   builds the draft worker before the KV pools.
3b. ``KVCacheConfigurator._build_hybrid_req_pool`` (AROUND): a Mamba / linear hybrid's request pool, which
   holds its per-request conv and SSM state, is built as the elastic
   :class:`~sglang_elastic_kv.mamba.ElasticHybridReqToTokenPool` (:func:`build_hybrid_req_pool_around`).
4. ``KVCacheConfigurator.configure`` (AFTER): the configured allocator must be elastic and the layout one
   the elastic pool reproduces; a hybrid's request pool must be the elastic one, whose slot allocator then
   follows the token allocator's release epochs, idle checks and sleep/wake; a path that bypassed the
   seams (``--enable-unified-memory`` builds its pools elsewhere) or asked for the page-major layout fails
   start-up instead of running native.
5. ``release_memory_occupation`` / ``resume_memory_occupation`` (AFTER): SGLang flushes the cache on
   release (``clear()`` returns every block); the hook also puts the pools the configurator returned
   in this process (4. records them) to sleep, so that their idle housekeeping does not map a reserve
   again until ``resume``.
6. ``release_kv_cache`` (AFTER): after a request's KV row went to the prefix cache, the cache gives back
   what the pool cannot keep, through its own ``evict`` (any tree cache: ``UnifiedRadixCache``, the engine
   default, and ``RadixCache`` alike): everything evictable while the pool is over its limit (``kvctl``
   lowered it below use: cached entries would otherwise keep their pages backed for good), else the excess
   over ``ELASTIC_KV_SGLANG_MAX_CACHED_TOKENS`` when that bound is set.
7. ``ScheduleBatch.retract_decode`` (AFTER): the requests SGLang retracted for want of memory are counted
   in the pool's snapshot (``preemptions``), which ``kvctl limit --wait`` reports; while the pool is over
   its limit, the prefixes they unlocked are evicted at once (as in 6.).
8. ``Scheduler.__init__`` (AFTER): the scheduler's elastic allocators follow its running requests, so that
   a lowered limit drains the pages of the requests SGLang retracts first and decode capacity is refused
   while requests hold slots on draining pages (:mod:`sglang_elastic_kv.drain`).
9. ``Scheduler._poll_timeout_aborts`` (AFTER): waiting requests that need more than a pool's limit or
   budget lets a request hold are aborted with a message, as SGLang aborts requests that waited too long;
   ``Scheduler.on_idle`` (AFTER): with nothing in flight, a pool over its limit evicts its cached prefixes,
   and while requests wait for memory the scheduler sleeps as when idle (:mod:`sglang_elastic_kv.fit`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from elastic_kv.errors import ConfigError

from sglang_elastic_kv import fit
from sglang_elastic_kv.compat import Seams
from sglang_elastic_kv.config import PluginConfig

__all__ = ["install"]

logger = logging.getLogger(__name__)

# The elastic allocators this process's configurator returned (one per scheduler; sleep/wake reach them).
_configured: list[Any] = []


def install(registry: Any, hook_type: Any, seams: Seams, config: PluginConfig) -> None:
    """Register the memory hooks of ``seams`` with SGLang's ``HookRegistry`` (applied by SGLang)."""
    registry.register(seams.kv_pool_cls, kv_pool_cls_after, hook_type.AFTER)
    registry.register(seams.paged_allocator_cls, paged_allocator_cls_after, hook_type.AFTER)
    registry.register(seams.scheduler_init, refuse_unserved_before, hook_type.BEFORE)
    registry.register(seams.scheduler_init, follow_scheduler_after, hook_type.AFTER)
    registry.register(seams.allocator_builder, build_allocator_around, hook_type.AROUND)
    registry.register(seams.hybrid_req_pool_builder, build_hybrid_req_pool_around, hook_type.AROUND)
    registry.register(seams.configure, verify_configured_after, hook_type.AFTER)
    registry.register(seams.release_memory, release_memory_after, hook_type.AFTER)
    registry.register(seams.resume_memory, resume_memory_after, hook_type.AFTER)
    release = functools.partial(release_kv_cache_after, config.max_cached_tokens)
    registry.register(seams.release_kv_cache, release, hook_type.AFTER)
    registry.register(seams.retract_decode, retract_decode_after, hook_type.AFTER)
    registry.register(seams.poll_aborts, fit.poll_aborts_after, hook_type.AFTER)
    registry.register(seams.on_idle, on_idle_after, hook_type.AFTER)


def on_idle_after(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.on_idle``: with nothing in flight, a pool over its limit evicts its cached prefixes
    (SGLang evicts only when it allocates, so an idle engine would keep the pages they hold and never get
    under a lowered limit); then :func:`sglang_elastic_kv.fit.on_idle_after` (requests waiting for memory)."""
    allocator = scheduler.token_to_kv_pool_allocator
    if (
        is_elastic_allocator(allocator)
        and allocator.elastic_over_limit()
        and scheduler.is_fully_idle(ignore_waiting=True)
    ):
        allocator.elastic_evict(scheduler.tree_cache)
    fit.on_idle_after(result, scheduler, *args, **kwargs)


def kv_pool_cls_after(result: type | None, platform: Any, *args: Any, kind: str | None = None) -> type | None:
    """The elastic pool class for ``kind`` where the platform answered None (in-tree class)."""
    kind = kind if kind is not None else (args[0] if args else None)
    from sglang_elastic_kv.pool import ElasticMHATokenToKVPool, ElasticMLATokenToKVPool

    elastic: dict[str, type] = {"mha": ElasticMHATokenToKVPool, "mla": ElasticMLATokenToKVPool}
    if kind not in elastic:
        # SGLang resolves every kind up front; a DSA pool that is actually built is refused by the
        # allocator check below, with the model named.
        return result
    if result is not None and not issubclass(result, elastic[kind]):
        raise ConfigError(
            f"platform {type(platform).__name__} supplies its own {kind} KV pool ({result.__name__}); "
            "--kv-cache-backend=elastic cannot combine with it"
        )
    return elastic[kind]


def paged_allocator_cls_after(result: type | None, platform: Any, *args: Any, **kwargs: Any) -> type:
    """The elastic paged allocator where the platform answered None."""
    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator

    if result is not None and not issubclass(result, ElasticPagedTokenToKVPoolAllocator):
        raise ConfigError(
            f"platform {type(platform).__name__} supplies its own paged allocator ({result.__name__}); "
            "--kv-cache-backend=elastic cannot combine with it"
        )
    return ElasticPagedTokenToKVPoolAllocator


def is_elastic_allocator(allocator: Any) -> bool:
    """Whether ``allocator`` is one of the plugin's (token, paged, or the SWA composite over them)."""
    from sglang_elastic_kv.allocator.base import ElasticAllocatorMixin
    from sglang_elastic_kv.allocator.pure_swa import ElasticPureSWAAllocator
    from sglang_elastic_kv.allocator.swa import ElasticSWATokenToKVPoolAllocator

    return isinstance(
        allocator, (ElasticAllocatorMixin, ElasticSWATokenToKVPoolAllocator, ElasticPureSWAAllocator)
    )


def refuse_speculative(algorithm: str | None) -> None:
    """ConfigError when speculative decoding (``--speculative-algorithm``, by name) is asked for.

    A draft model's worker builds its own KV pool (elastic, through the platform seam) but shares the
    target's allocator, which backs only the target pool's pages: the draft would write KV to unbacked
    memory. NGRAM has no draft pool, but its verify step needs kernels that SGLang 0.5.23's CPU engine
    lacks (``sgl_kernel.speculative``), so no test here can run it against elastic KV.
    """
    if algorithm and algorithm.upper() != "NONE":
        raise ConfigError(
            f"--kv-cache-backend=elastic does not serve speculative decoding (--speculative-algorithm "
            f"{algorithm}): a draft model's KV pool would not be backed by the target's allocator it shares, "
            "and no verify path was run with elastic KV; use --kv-cache-backend=native"
        )


def refuse_unserved_before(scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``Scheduler.__init__``: refuse what the server arguments already show is not served, before
    the scheduler builds workers (SGLang builds a speculative draft worker before the KV pools)."""
    refuse_speculative(server_args.speculative_algorithm)


def follow_scheduler_after(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.__init__``: every elastic allocator of the scheduler follows its running decode
    batch (:meth:`~sglang_elastic_kv.allocator.base.ElasticAllocatorMixin.elastic_follow`)."""
    from sglang_elastic_kv import compat

    allocator = scheduler.token_to_kv_pool_allocator
    if not is_elastic_allocator(allocator):
        return
    compat.check_instance(scheduler, "sglang.srt.managers.scheduler.Scheduler")
    compat.check_instance(scheduler.req_to_token_pool, "sglang.srt.mem_cache.memory_pool.ReqToTokenPool")

    def running() -> tuple[Any, Any]:
        return scheduler.running_batch.reqs, scheduler.req_to_token_pool

    for part in allocator.elastic_parts():
        part.elastic_follow(running)


def build_hybrid_req_pool_around(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's hybrid request pool for Mamba / linear hybrids, built as
    :class:`~sglang_elastic_kv.mamba.ElasticHybridReqToTokenPool` with SGLang's own arguments: the builder
    names ``HybridReqToTokenPool`` from its module, which points at the elastic subclass for this call.

    Served are the hybrids an engine test proves: Gated DeltaNet ones (``hybrid_gdn_config``, Qwen3-Next).
    Mamba2 (Nemotron-H, Falcon-H1) and KDA hybrids share the pool's code but are refused until an engine
    runs them (SGLang's CPU engine has no Mamba2 or KDA kernels to prove them on)."""
    from sglang.srt.mem_cache import kv_cache_configurator

    from sglang_elastic_kv.mamba import ElasticHybridReqToTokenPool

    if configurator.hybrid_gdn_config is None:
        hf_config = getattr(configurator.model_config, "hf_config", None)
        arch = ", ".join(getattr(hf_config, "architectures", None) or ["this model"])
        raise ConfigError(
            f"--kv-cache-backend=elastic serves Gated DeltaNet hybrids (Qwen3-Next) among SGLang's state "
            f"models; {arch} (Mamba2 / KDA state) is not proven with it yet: use --kv-cache-backend=native"
        )

    native = kv_cache_configurator.HybridReqToTokenPool
    kv_cache_configurator.HybridReqToTokenPool = ElasticHybridReqToTokenPool
    try:
        pool = original(configurator, *args, **kwargs)
    finally:
        kv_cache_configurator.HybridReqToTokenPool = native
    if not isinstance(pool, ElasticHybridReqToTokenPool):
        raise ConfigError(
            f"--kv-cache-backend=elastic: SGLang built {type(pool).__name__} for this hybrid model's state, "
            "not the elastic request pool; use --kv-cache-backend=native"
        )
    return pool


def build_allocator_around(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    """Build SGLang's allocator, make it elastic where SGLang built an in-tree allocator directly, and
    refuse what is not served."""
    from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator, SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from sglang_elastic_kv.allocator.paged import ElasticPagedTokenToKVPoolAllocator
    from sglang_elastic_kv.allocator.pure_swa import ElasticPureSWAAllocator
    from sglang_elastic_kv.allocator.swa import ElasticSWATokenToKVPoolAllocator
    from sglang_elastic_kv.allocator.token import ElasticTokenToKVPoolAllocator

    spec = configurator.spec_algorithm
    refuse_speculative(None if spec.is_none() else str(spec.name))
    allocator = original(configurator, *args, **kwargs)

    if type(allocator) is TokenToKVPoolAllocator:
        allocator = ElasticTokenToKVPoolAllocator(
            allocator.size, allocator.dtype, allocator.device, allocator.get_kvcache(), allocator.need_sort
        )
    elif type(allocator) is PureSWATokenToKVPoolAllocator:
        allocator = ElasticPureSWAAllocator(
            allocator.size_swa,
            allocator.page_size,
            allocator.dtype,
            allocator.device,
            allocator.get_kvcache(),
            allocator.need_sort,
        )
    elif type(allocator) is SWATokenToKVPoolAllocator:
        # SGLang built it with plain page_size-1 sub-allocators (or elastic paged ones via the platform
        # seam); rebuild it with the same arguments as the elastic composite, which checks its sub-pools.
        allocator = ElasticSWATokenToKVPoolAllocator(
            allocator.size_full,
            allocator.size_swa,
            allocator.page_size,
            allocator.dtype,
            allocator.device,
            allocator.get_kvcache(),
            allocator.need_sort,
            allocator._req_to_token_pool,
        )
    if not is_elastic_allocator(allocator):
        raise ConfigError(
            f"--kv-cache-backend=elastic does not serve SGLang's {type(allocator).__name__} "
            f"(KV pool {type(allocator.get_kvcache()).__name__}); supported: "
            f"{ElasticTokenToKVPoolAllocator.__name__}, {ElasticPagedTokenToKVPoolAllocator.__name__} "
            f"over an MHA or MLA pool, {ElasticSWATokenToKVPoolAllocator.__name__} over a hybrid SWA pool, "
            f"{ElasticPureSWAAllocator.__name__} over an all-sliding one"
        )
    kvcache: Any = allocator.get_kvcache()
    logger.info("elastic KV allocator: %s over %s", type(allocator).__name__, type(kvcache).__name__)
    return allocator


def verify_configured_after(result: Any, configurator: Any, *args: Any, **kwargs: Any) -> None:
    """Refuse a configured KV cache that is not (entirely) elastic; see the module docstring."""
    if configurator._page_major_enabled():
        raise ConfigError(
            "--kv-cache-backend=elastic does not serve --enable-page-major-kv-layout (the elastic pool keeps "
            "SGLang's per-layer layout)"
        )
    allocator = result.token_to_kv_pool_allocator
    if not is_elastic_allocator(allocator):
        raise ConfigError(
            f"--kv-cache-backend=elastic: SGLang configured {type(allocator).__name__} without the platform "
            "seams this plugin serves (e.g. --enable-unified-memory); use --kv-cache-backend=native"
        )
    if configurator.mambaish_config is not None:
        attach_state_pool(allocator, result.req_to_token_pool)
    if not any(allocator is known for known in _configured):  # record each allocator once
        _configured.append(allocator)


def attach_state_pool(allocator: Any, req_to_token_pool: Any) -> None:
    """A Mamba / linear hybrid: its state pool must be elastic, and its slot allocator follows the token
    allocator's release epochs, idle checks and sleep/wake (:meth:`ElasticAllocatorMixin.elastic_attach`)."""
    from sglang_elastic_kv.allocator.base import ElasticAllocatorMixin
    from sglang_elastic_kv.mamba import ElasticHybridReqToTokenPool

    if not isinstance(req_to_token_pool, ElasticHybridReqToTokenPool):
        raise ConfigError(
            "--kv-cache-backend=elastic: this hybrid model's state lives in "
            f"{type(req_to_token_pool).__name__}, not the elastic request pool (a path that bypasses "
            "_build_hybrid_req_pool, e.g. --enable-unified-memory); use --kv-cache-backend=native"
        )
    if not isinstance(allocator, ElasticAllocatorMixin):
        raise ConfigError(
            "--kv-cache-backend=elastic does not serve Mamba / linear hybrids with "
            f"{type(allocator).__name__}"
        )
    slots = req_to_token_pool.mamba_allocator
    slots.elastic_slots_per_request = 1 + int(req_to_token_pool.mamba_initial_tracking_slots)
    allocator.elastic_attach(slots)


def _kv_tags(recv_req: Any) -> bool:
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    tags = recv_req.tags
    return not tags or GPU_MEMORY_TYPE_KV_CACHE in tags  # None or empty = every tag, as SGLang reads it


def release_memory_after(result: Any, updater: Any, recv_req: Any, *a: Any, **k: Any) -> None:
    """After SGLang released the KV cache (its flush gave every block back): unmap the reserve of every
    elastic allocator this process configured, and keep it unmapped until resume."""
    if _kv_tags(recv_req):
        for allocator in _configured:
            allocator.elastic_sleep()


def resume_memory_after(result: Any, updater: Any, recv_req: Any, *a: Any, **k: Any) -> None:
    """After SGLang resumed the KV cache: the pools map on demand again (nothing to restore)."""
    if _kv_tags(recv_req):
        for allocator in _configured:
            allocator.elastic_wake()


def release_kv_cache_after(
    max_cached_tokens: int, result: Any, req: Any, tree_cache: Any, *a: Any, **k: Any
) -> None:
    """After a release, evict (LRU first) everything evictable from the prefix cache while its pool is over
    its limit, else what it holds beyond ``max_cached_tokens`` (0: no bound)."""
    _evict_cached(tree_cache, max_cached_tokens)


def _evict_cached(tree_cache: Any, max_cached_tokens: int = 0) -> None:
    """The allocators' one eviction path (``elastic_evict``: every side of a composite): everything
    evictable while a pool is over its limit, else the excess over ``max_cached_tokens`` (0: no bound)."""
    allocator: Any = getattr(tree_cache, "token_to_kv_pool_allocator", None)
    if is_elastic_allocator(allocator):
        allocator.elastic_evict(tree_cache, 0, max_cached_tokens)


def retract_decode_after(result: Any, batch: Any, *a: Any, **k: Any) -> None:
    """After SGLang retracted decode requests: count them in the pool's snapshot (the requests it aborted
    instead are not preempted, and not counted)."""
    allocator: Any = getattr(batch, "token_to_kv_pool_allocator", None)
    if result and result[0] and is_elastic_allocator(allocator):
        allocator.elastic_note_retracted(len(result[0]))
        # The retracted requests unlocked their cached prefixes: while the pool shrinks, those go now,
        # before the requests are admitted again and would match them on the pages being released.
        _evict_cached(batch.tree_cache)
