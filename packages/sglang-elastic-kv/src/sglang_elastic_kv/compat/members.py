"""Every SGLang member the plugin relies on, and the checks that find one missing.

* :data:`MEMBERS`: members found on a module or class (methods, functions, classes, constants, declared
  fields). :func:`missing_members` resolves all of them; :func:`sglang_elastic_kv.compat.select` does at
  start-up (``register()`` in every SGLang process, ``prepare_server_args`` in the launcher) and fails with
  one line naming what is missing and the version. SGLang's ``HookRegistry`` only logs a hook target it
  cannot resolve, so without this check a moved target would leave the engine silently native or half
  elastic.
* :data:`INSTANCE_MEMBERS`: attributes SGLang's constructors set on an instance (no class attribute to
  resolve); the plugin's subclasses call :func:`check_instance` on themselves while SGLang builds them,
  i.e. during the scheduler's start-up.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Mapping
from typing import Any

from elastic_kv.errors import ConfigError

from sglang_elastic_kv.compat.versions import (
    ALLOC,
    CONFIGURATOR,
    PLATFORM,
    POOLS,
    WEIGHT_UPDATER,
    installed_sglang_version,
    supported_text,
)

__all__ = ["INSTANCE_MEMBERS", "MEMBERS", "check_instance", "missing_members"]

# Owner (module or class, dotted) -> the members of it the plugin hooks, subclasses, overrides, calls or
# reads. Declared fields of dataclasses and msgspec structs resolve on the class; annotated attributes
# count too.
MEMBERS: Mapping[str, tuple[str, ...]] = {
    "sglang.srt.plugins.hook_registry": ("HookRegistry", "HookType"),
    "sglang.srt.plugins.hook_registry.HookType": ("BEFORE", "AFTER", "AROUND"),
    "sglang.srt.server_args": ("prepare_server_args", "ServerArgs"),
    "sglang.srt.server_args.ServerArgs": ("add_cli_args", "speculative_algorithm"),
    "sglang.srt.managers.scheduler.Scheduler": (
        "__init__",
        "_poll_timeout_aborts",
        "on_idle",
        "is_fully_idle",
        "maybe_sleep_on_idle",
    ),
    "sglang.srt.managers.io_struct.AbortReq": ("rid", "abort_message", "finished_reason"),
    "sglang.srt.managers.schedule_batch.Req": ("seqlen", "finished"),
    "sglang.srt.managers.schedule_batch.ScheduleBatch": (
        "is_empty",
        "retract_decode",
        "token_to_kv_pool_allocator",
        "reqs",
        "tree_cache",
        "_get_decode_retraction_order",
    ),
    # Which slots a running request holds (drain.request_blocks reads ``Req.kv``, set per instance).
    "sglang.srt.managers.schedule_batch.ReqKvInfo": ("req_pool_idx", "kv_allocated_len"),
    PLATFORM: ("get_kv_pool_cls", "get_paged_allocator_cls"),
    "sglang.srt.mem_cache.kv_cache_configurator": ("HybridReqToTokenPool",),
    CONFIGURATOR: (
        "_build_token_to_kv_pool_allocator",
        "_build_hybrid_req_pool",
        "configure",
        "_page_major_enabled",
        "spec_algorithm",
        "mambaish_config",
        "hybrid_gdn_config",
        "model_config",
    ),
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm": ("is_none", "NONE"),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigResult": (
        "token_to_kv_pool_allocator",
        "req_to_token_pool",
    ),
    WEIGHT_UPDATER: ("release_memory_occupation", "resume_memory_occupation"),
    "sglang.srt.managers.io_struct.ReleaseMemoryOccupationReqInput": ("tags",),
    "sglang.srt.managers.io_struct.ResumeMemoryOccupationReqInput": ("tags",),
    "sglang.srt.constants": ("GPU_MEMORY_TYPE_KV_CACHE",),
    "sglang.srt.mem_cache.common": ("release_kv_cache",),
    POOLS: (
        "KVCache",
        "MHATokenToKVPool",
        "MLATokenToKVPool",
        "MambaPool",
        "HybridReqToTokenPool",
        "HybridLinearKVPool",
    ),
    f"{POOLS}.MambaPool": (
        "__init__",
        "State",
        "_conv_fuse_ok",
        "_conv_slot_desc",
        "_warmup_fused_copy_slot_kernel",
    ),
    f"{POOLS}.MambaPool.State": ("conv", "temporal"),
    f"{POOLS}.HybridReqToTokenPool": ("mamba_pool_cls", "_init_mamba_pool", "clone_with_new_mamba"),
    f"{ALLOC}.mamba": ("MambaSlotAllocator",),
    f"{ALLOC}.mamba.MambaSlotAllocator": (
        "__init__",
        "clear",
        "available_size",
        "schedulable_available_size",
        "alloc",
        "_do_alloc",
        "free",
        "alloc_group_begin",
        "alloc_group_end",
    ),
    "sglang.srt.utils": ("is_cpu", "is_npu", "cpu_has_amx_support", "get_num_new_pages"),
    f"{POOLS}.KVCache": ("__init__",),
    f"{POOLS}.MHATokenToKVPool": ("_create_buffers", "_create_buffers_normal", "_kv_buffer_shapes"),
    f"{POOLS}.MLATokenToKVPool": ("_create_buffers",),
    "sglang.srt.mem_cache.swa_memory_pool": ("SWAKVPool",),
    f"{ALLOC}.base.BaseTokenToKVPoolAllocator": (
        "get_kvcache",
        "free_group_begin",
        "free_group_end",
        "merge_and_sort_free",
        "verify_byte_accounting",
        "create_prefill_budget",
        "evict_to_free_tokens",
        "check_decode_capacity",
    ),
    f"{ALLOC}.token": ("TokenToKVPoolAllocator",),
    f"{ALLOC}.token.TokenToKVPoolAllocator": ("__init__", "clear", "available_size", "alloc", "free"),
    f"{ALLOC}.paged": ("PagedTokenToKVPoolAllocator",),
    f"{ALLOC}.paged.PagedTokenToKVPoolAllocator": (
        "__init__",
        "clear",
        "available_size",
        "alloc",
        "alloc_extend",
        "alloc_decode",
        "merge_and_sort_free",
        "_release_page_ids",
    ),
    f"{ALLOC}.swa": ("SWATokenToKVPoolAllocator", "PureSWATokenToKVPoolAllocator"),
    f"{ALLOC}.swa.SWATokenToKVPoolAllocator": (
        "__init__",
        "size_full",
        "size_swa",
        "new_pages_available",
        "alloc",
        "alloc_extend",
        "alloc_extend_swa_tail",
        "alloc_decode",
        "translate_loc_from_full_to_swa",
        "free_group_begin",
        "free_group_end",
        "create_prefill_budget",
        "evict_to_free_tokens",
        "check_decode_capacity",
        "verify_byte_accounting",
    ),
    f"{ALLOC}.swa.PureSWATokenToKVPoolAllocator": (
        "__init__",
        "alloc",
        "free",
        "free_group_begin",
        "free_group_end",
        "clear",
        "create_prefill_budget",
        "swa_available_size",
        "size_swa",
        "get_kvcache",
    ),
    "sglang.srt.mem_cache.prefill_budget": ("PrefillBudget", "SWAPrefillBudget"),
    "sglang.srt.mem_cache.prefill_budget.PrefillBudget": (
        "__init__",
        "_available_and_evictable",
        "has_capacity",
        "check_prefill",
        "can_allocate_prefill",
        "reserve",
    ),
    "sglang.srt.mem_cache.prefill_budget.SWAPrefillBudget": ("_available_and_evictable", "remaining_swa"),
    "sglang.srt.mem_cache.base_prefix_cache": ("EvictParams", "BasePrefixCache"),
    "sglang.srt.mem_cache.base_prefix_cache.EvictParams": ("num_tokens", "swa_num_tokens"),
    "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache": (
        "token_to_kv_pool_allocator",
        "supports_prefix_sharing",
        "evict",
        "evictable_size",
        "full_evictable_size",
        "swa_evictable_size",
        "supports_mamba",
    ),
}

# Class (dotted) -> attributes its constructor sets on every instance, read by the plugin. Checked by
# :func:`check_instance` on the plugin's own subclasses (and on the SGLang objects they are handed).
INSTANCE_MEMBERS: Mapping[str, tuple[str, ...]] = {
    # What the drain reads of the running scheduler (hooks.follow_scheduler_after; drain.py), and what
    # fit.py reads to end the requests that can never fit and to sleep while requests wait for memory.
    "sglang.srt.managers.scheduler.Scheduler": (
        "running_batch",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "waiting_queue",
        "tree_cache",
    ),
    f"{POOLS}.ReqToTokenPool": ("req_to_token",),
    f"{POOLS}.MHATokenToKVPool": (
        "size",
        "page_size",
        "device",
        "layer_num",
        "store_dtype",
        "allocation_label",
        "is_quantized_kv_cache",
        "post_capture_active",
        "kv_cache_layout",
        "memory_saver_adapter",
        "enable_custom_mem_pool",
    ),
    f"{POOLS}.MLATokenToKVPool": (
        "size",
        "page_size",
        "device",
        "layer_num",
        "store_dtype",
        "allocation_label",
        "kv_cache_dim",
        "memory_saver_adapter",
        "custom_mem_pool",
    ),
    "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool": ("full_kv_pool", "swa_kv_pool"),
    f"{POOLS}.MambaPool": (
        "size",
        "device",
        "mamba_cache",
        "num_mamba_layers",
        "enable_custom_mem_pool",
        "mem_usage",
    ),
    f"{POOLS}.HybridReqToTokenPool": (
        "mamba_pool",
        "mamba_allocator",
        "mamba_initial_tracking_slots",
        "mamba_ckpt_pool",
        "short_conv_pool",
        "ngram_pool",
    ),
    f"{POOLS}.HybridLinearKVPool": ("full_kv_pool",),
    f"{ALLOC}.mamba.MambaSlotAllocator": ("size", "device", "free_slots", "_alloc_iter"),
    f"{ALLOC}.token.TokenToKVPoolAllocator": (
        "size",
        "page_size",
        "dtype",
        "device",
        "need_sort",
        "free_pages",
        "release_pages",
        "free_group",
    ),
    f"{ALLOC}.paged.PagedTokenToKVPoolAllocator": (
        "size",
        "page_size",
        "num_pages",
        "device",
        "need_sort",
        "free_pages",
        "num_staged_pages",
    ),
    f"{ALLOC}.swa.SWATokenToKVPoolAllocator": (
        "page_size",
        "dtype",
        "device",
        "need_sort",
        "full_attn_allocator",
        "swa_attn_allocator",
        "_swa_req_ring",
        "_req_to_token_pool",
    ),
    f"{ALLOC}.swa.PureSWATokenToKVPoolAllocator": (
        "page_size",
        "dtype",
        "device",
        "need_sort",
        "swa_attn_allocator",
        "full_attn_allocator",
        "free_group",
    ),
    "sglang.srt.mem_cache.prefill_budget.PrefillBudget": ("allocator", "tree_cache"),
    "sglang.srt.mem_cache.prefill_budget.SWAPrefillBudget": ("swa_offset",),
}


def _has(owner: Any, name: str) -> bool:
    if hasattr(owner, name):
        return True
    mro = owner.__mro__ if isinstance(owner, type) else ()
    return any(name in getattr(cls, "__annotations__", {}) for cls in mro)


def missing_members() -> list[str]:
    """The dotted names of :data:`MEMBERS` that the installed SGLang lacks (imports their owners)."""
    missing: list[str] = []
    for owner_name, names in MEMBERS.items():
        try:
            owner = pkgutil.resolve_name(owner_name)
        except Exception:  # any release: a module that fails to import lacks its members too
            missing.append(owner_name)
            continue
        missing += [f"{owner_name}.{name}" for name in names if not _has(owner, name)]
    return missing


def check_instance(obj: Any, owner: str) -> None:
    """Raise ConfigError (one line) unless ``obj`` carries every attribute :data:`INSTANCE_MEMBERS` lists
    for the SGLang class ``owner`` (dotted), which SGLang's constructor sets."""
    missing = [name for name in INSTANCE_MEMBERS[owner] if not hasattr(obj, name)]
    if missing:
        version = installed_sglang_version()
        raise ConfigError(
            f"--kv-cache-backend=elastic: sglang {version}'s {owner} instances lack "
            f"{', '.join(missing)}, which the plugin relies on (supported: {supported_text()})"
        )
