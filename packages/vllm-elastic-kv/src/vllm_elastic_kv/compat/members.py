"""Every vLLM attribute, field and instance member the plugin reads or sets, beside the signature table.

:mod:`vllm_elastic_kv.compat.versions` lists the functions, methods, classes and rebound module-level names
the plugin calls, overrides, wraps or rebinds (checked by signature). This module lists the rest of what it
relies on, so that together they name every vLLM member the plugin touches, public or private:

* :data:`MEMBERS`: members found on a module or class (attributes, dataclass and config fields, properties,
  methods the plugin overrides without a signature contract). :func:`missing_members` resolves them;
  activation (:func:`vllm_elastic_kv.frontend.activation.activate`, in the front end, before any engine
  process starts) fails with one line naming every missing member and the vLLM version.
* :data:`MEMBERS_BY_ALLOCATION`: the same, for the members that differ between the KV allocation styles of
  :data:`~vllm_elastic_kv.compat.versions.SUPPORT` (``KVCacheTensor``'s fields).
* :data:`INSTANCE_MEMBERS`: attributes vLLM's constructors set on every instance (no class attribute to
  resolve); the plugin's subclasses call :func:`check_instance` on themselves right after vLLM's constructor,
  i.e. while the engine starts.
* :data:`ADDED_ATTRIBUTES`: attributes the plugin sets on vLLM objects; their classes must accept new
  attributes (no ``__slots__``), checked with :data:`MEMBERS`.
* :data:`PROBED`: members read with a fallback (``getattr`` with a default), because some supported
  release lacks them; each entry states what the plugin does without it. Their absence is never an error.

Checked on the installed vLLM by ``tests/vllm/test_vllm_compat_members.py`` and, for every supported
release, on its source by ``ci/compat_check.py`` (``tests/vllm/test_vllm_compat.py``).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Mapping
from typing import Any

from elastic_kv.errors import ConfigError

from vllm_elastic_kv.compat.versions import VersionSupport, installed_version

__all__ = [
    "ADDED_ATTRIBUTES",
    "CPU_MEMBERS",
    "INSTANCE_MEMBERS",
    "MEMBERS",
    "MEMBERS_BY_ALLOCATION",
    "PROBED",
    "check_instance",
    "missing_members",
]

_POOL = "vllm.v1.core.block_pool.BlockPool"
_UTILS = "vllm.v1.core.kv_cache_utils"
_IFACE = "vllm.v1.kv_cache_interface"
_CONFIG = "vllm.config"
_CORE = "vllm.v1.engine.core.EngineCore"
_NEXT_STEP = "kvctl changes reach an idle engine at its next step"

# Owner (module or class, dotted) -> members of it the plugin reads, sets or overrides. Declared fields of
# dataclasses and config classes resolve on the class; annotated attributes count too.
MEMBERS: Mapping[str, tuple[str, ...]] = {
    "vllm": ("__version__",),
    # block pool: the ids the pool hands out and takes back, the LRU queue of cached blocks
    _UTILS: ("KVCacheBlock", "FreeKVCacheBlockQueue"),
    f"{_UTILS}.KVCacheBlock": (
        "block_id",
        "ref_cnt",
        "block_hash",
        "is_null",
        "prev_free_block",
        "next_free_block",
        "reset_hash",
    ),
    "vllm.v1.core.kv_cache_manager.KVCacheBlocks": ("blocks",),
    # scheduler: add_request is overridden (maps ahead for the prompt); the step's shape is read
    "vllm.v1.core.sched.scheduler.Scheduler": ("add_request",),
    "vllm.v1.core.sched.output.SchedulerOutput": ("total_num_scheduled_tokens", "num_scheduled_tokens"),
    "vllm.v1.request.Request": ("num_tokens", "is_finished"),
    # requests that can never fit end with vLLM's request-level error and an output of their own (fit)
    "vllm.v1.request.RequestStatus": ("FINISHED_ERROR",),
    "vllm.v1.engine": ("EngineCoreOutput", "EngineCoreOutputs", "FinishReason"),
    "vllm.v1.engine.EngineCoreOutput": ("request_id", "new_token_ids", "finish_reason", "stop_reason"),
    "vllm.v1.engine.EngineCoreOutputs": ("outputs",),
    "vllm.v1.engine.FinishReason": ("ERROR",),
    "vllm.platforms.interface.Platform": ("is_cpu", "is_cuda_alike", "is_rocm"),
    # configuration read at activation, by the scheduler and by the workers
    "vllm.engine.arg_utils.EngineArgs": ("additional_config",),
    f"{_CONFIG}.VllmConfig": (
        "additional_config",
        "scheduler_config",
        "parallel_config",
        "cache_config",
        "model_config",
        "compilation_config",
    ),
    f"{_CONFIG}.SchedulerConfig": ("async_scheduling", "scheduler_cls", "max_num_batched_tokens"),
    f"{_CONFIG}.ParallelConfig": (
        "data_parallel_size",
        "distributed_executor_backend",
        "pipeline_parallel_size",
        "worker_cls",
        "world_size",
    ),
    f"{_CONFIG}.CacheConfig": ("kv_cache_memory_bytes",),
    f"{_CONFIG}.ModelConfig": ("model", "enable_sleep_mode", "sleep_mode_backend", "max_model_len"),
    f"{_CONFIG}.CompilationConfig": ("static_forward_context",),
    # the KV cache plan the geometry is built from
    f"{_IFACE}.KVCacheConfig": ("num_blocks", "kv_cache_tensors", "kv_cache_groups"),
    f"{_IFACE}.KVCacheGroupSpec": ("kv_cache_spec", "layer_names"),
    f"{_IFACE}.KVCacheSpec": ("block_size",),
    f"{_IFACE}.SlidingWindowSpec": ("sliding_window",),
    f"{_IFACE}.KVCacheTensor": ("size",),
    # sleep mode into the host arena (vllm_elastic_kv.worker.sleep): each allocation's handle
    # (device, size, address, ...), tag, host copy and state, and the runtime library vLLM copies with
    "vllm.device_allocator.AllocationData": ("handle", "tag", "cpu_backup_tensor", "is_asleep"),
    "vllm.device_allocator.cumem": ("libcudart",),
}

# VersionSupport.kv_allocation -> further members for that allocation style.
MEMBERS_BY_ALLOCATION: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "one_buffer": {f"{_IFACE}.KVCacheTensor": ("layers", "layer_stride", "block_stride", "offset")},
    "per_tensor": {},
}

# Members looked up only where vLLM's platform is the CPU. Importing vLLM's CPU worker rebinds torch's device
# API for the whole process (vllm/v1/worker/cpu/shm.py: torch.cuda.Event, streams, Tensor.pin_memory,
# torch.accelerator's synchronize and memory info): on a GPU, a process that imported it -- and every
# engine process forked from it -- would time, pin and measure nothing. The CPU worker is subclassed like
# the GPU one.
CPU_MEMBERS: Mapping[str, tuple[str, ...]] = {
    "vllm.v1.worker.cpu_worker": ("CPUWorker",),
}

# Class (dotted) -> attributes its constructor sets on every instance, read by the plugin. Checked by
# check_instance() on the plugin's subclasses (and on the vLLM objects they hold) as they are built.
INSTANCE_MEMBERS: Mapping[str, tuple[str, ...]] = {
    _POOL: (
        "blocks",
        "free_block_queue",
        "num_gpu_blocks",
        "null_block",
        "enable_caching",
        "enable_kv_cache_events",
    ),
    f"{_UTILS}.FreeKVCacheBlockQueue": ("num_free_blocks",),
    "vllm.v1.core.kv_cache_manager.KVCacheManager": ("coordinator", "block_pool"),
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator": ("single_type_managers",),
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager": ("block_size",),
    # the limit's drain preempts the running requests holding blocks on draining pages (drain); a reset while
    # paused keeping them leaves them their blocks where the KV is parked (scheduler)
    "vllm.v1.core.sched.scheduler.Scheduler": ("kv_cache_manager", "running", "requests", "pause_state"),
    "vllm.v1.core.sched.interface": ("PauseState",),
    "vllm.v1.core.sched.interface.PauseState": ("PAUSED_ALL",),
    "vllm.v1.request.Request": ("request_id", "client_index"),
    # ... and its sleep-mode backend (elastic_kv_demote)
    "vllm.v1.worker.gpu_worker.Worker": ("vllm_config", "device", "rank", "_sleep_mode_backend"),
    "vllm.device_allocator.cumem.CuMemAllocator": ("pointer_to_data",),
}

# Class (dotted) -> attributes the plugin sets on its instances (the class must not use __slots__).
ADDED_ATTRIBUTES: Mapping[str, tuple[str, ...]] = {
    # carries the step's release epoch from schedule() to update_from_output()
    # (vllm_elastic_kv.scheduler.scheduler)
    "vllm.v1.core.sched.output.SchedulerOutput": ("_elastic_kv_epoch",),
}

# Dotted member -> what the plugin does where the running vLLM lacks it (read with a default).
PROBED: Mapping[str, str] = {
    f"{_POOL}._reuse_watchers": "no reuse watchers to notify when trimming cached blocks",
    f"{_POOL}._notify_reuse": "called only when _reuse_watchers holds a trimmed block",
    f"{_POOL}.metrics_collector": "no block metrics: the idle trim may forget the prefix cache at once",
    f"{_POOL}.cached_block_hashes_by_block": "the idle trim evicts cached blocks one by one",
    f"{_POOL}.cached_block_hash_to_block": "the idle trim evicts cached blocks one by one",
    f"{_UTILS}.KVCacheBlock.pool": "every block belongs to the one block pool (0.34+: a weak reference)",
    # how the idle engine core is found and woken (vllm_elastic_kv.scheduler.idle)
    f"{_CORE}Proc.input_queue": _NEXT_STEP,
    f"{_CORE}Proc._handle_client_request": _NEXT_STEP,
    f"{_CORE}._idle_state_callbacks": _NEXT_STEP,
    "vllm.v1.engine.EngineCoreRequestType.WAKEUP": _NEXT_STEP,
    "vllm.v1.worker.gpu_worker.Worker.model_runner": "no cross-layer KV sharing",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.shared_kv_cache_layers": "no cross-layer KV sharing",
    "vllm.v1.worker.gpu_worker.Worker._sleep_saved_buffers": (
        "0.34+ (a level-2 sleep keeps, allocator side, what reload_weights does not rewrite): no demotion"
    ),
    "vllm.v1.worker.gpu_worker.Worker.get_draft_model": "no draft model to refuse a demotion for",
    f"{_CONFIG}.ModelConfig.sleep_preserve_parameter_names": (
        "a level-2 sleep keeps no parameters: a demotion keeps the buffers only"
    ),
    f"{_CONFIG}.ModelConfig.served_model_name": "the pool is named after the model path",
    f"{_CONFIG}.VllmConfig.kv_transfer_config": "no KV connectors to refuse",
    f"{_CONFIG}.VllmConfig.speculative_config": "no speculative decoding to refuse",
    f"{_CONFIG}.CacheConfig.kv_offloading_size": "no KV offloading to refuse",
    f"{_CONFIG}.ModelConfig.is_encoder_decoder": "no encoder-decoder model to refuse",
    f"{_CONFIG}.CacheConfig.enable_extensible_kv_cache": "no extensible KV cache (before 0.34) to turn off",
    "vllm.v1.request.Request.async_tokens_to_discard": (
        "0.31+: the limit's drain drops a preempted request's in-flight output with drop_stale_output"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.prev_step_scheduled_req_ids": (
        "Model Runner V2 only (0.34): a preempted request's tokens need no resending"
    ),
    f"{_CONFIG}.CacheConfig.kv_cache_layout": "the layout comes from KVCacheConfig.kv_cache_layout",
    f"{_IFACE}.KVCacheConfig.kv_cache_layout": "the layout comes from CacheConfig.kv_cache_layout",
    f"{_IFACE}.KVCacheGroupSpec.host_resident": "no host-resident KV cache groups to refuse",
    f"{_IFACE}.KVCacheTensor.block_stride": "0.26-0.28: no packed (hybrid) layout to refuse",
    f"{_IFACE}.UniformTypeKVCacheSpecs.kv_cache_specs": "one spec per group",
    f"{_IFACE}.MambaSpec.mamba_cache_mode": "no Mamba prefix caching ('align') to refuse",
    "vllm.model_executor.layers.attention.attention.Attention.has_sink": "no attention sinks to count",
    "vllm.model_executor.layers.attention.attention.Attention.kv_cache": "a layer without KV is skipped",
}


def _has(owner: Any, name: str) -> bool:
    if hasattr(owner, name):
        return True
    mro = owner.__mro__ if isinstance(owner, type) else ()
    return any(name in getattr(cls, "__annotations__", {}) for cls in mro)


def _resolve(owner: str) -> Any | None:
    try:
        return pkgutil.resolve_name(owner)
    except (ImportError, AttributeError, ValueError):
        return None


def missing_members(support: VersionSupport) -> list[str]:
    """The dotted names of :data:`MEMBERS` (and ``support``'s :data:`MEMBERS_BY_ALLOCATION`; on the CPU
    platform :data:`CPU_MEMBERS`) that the installed vLLM lacks, and the :data:`ADDED_ATTRIBUTES` owners whose
    instances take no new attribute. Imports the owners."""
    from vllm.platforms import current_platform

    missing: list[str] = []
    tables = [MEMBERS, MEMBERS_BY_ALLOCATION[support.kv_allocation]]
    if current_platform.is_cpu():
        tables.append(CPU_MEMBERS)
    for table in tables:
        for owner_name, names in table.items():
            owner = _resolve(owner_name)
            if owner is None:
                missing.append(owner_name)
                continue
            missing += [f"{owner_name}.{name}" for name in names if not _has(owner, name)]
    for owner_name, names in ADDED_ATTRIBUTES.items():
        owner = _resolve(owner_name)
        if not isinstance(owner, type) or not owner.__dictoffset__:
            missing += [f"{owner_name}.{name} (settable)" for name in names]
    return missing


def check_instance(obj: Any, owner: str) -> None:
    """Raise ConfigError (one line) unless ``obj`` carries every attribute :data:`INSTANCE_MEMBERS` lists
    for the vLLM class ``owner`` (dotted), which vLLM's constructor sets."""
    missing = [name for name in INSTANCE_MEMBERS[owner] if not hasattr(obj, name)]
    if missing:
        version = ".".join(map(str, installed_version()))
        raise ConfigError(
            f"--kv-cache-backend=elastic: vLLM {version}'s {owner} instances lack {', '.join(missing)}, "
            "which vllm-elastic-kv relies on; use --kv-cache-backend=native, or a vLLM the plugin supports"
        )
