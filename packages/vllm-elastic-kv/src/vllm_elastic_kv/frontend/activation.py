"""Front end: turn ``kv_cache_backend=elastic`` into the official hooks vLLM runs with, or refuse clearly.

Every way of starting vLLM (``LLM``, ``AsyncLLM``, ``vllm serve``) builds its ``VllmConfig`` with
``EngineArgs.create_engine_config``. The plugin wraps it: with the native backend the wrapper returns vLLM's
config untouched; with the elastic backend it

1. refuses what the plugin does not support (an unsupported vLLM version, a custom scheduler or worker
   class, data parallelism, a multi-host executor, KV connectors / offloading, speculative
   decoding other than n-gram drafts or a draft model, encoder-decoder models) with one
   :class:`~elastic_kv.errors.ConfigError` naming each;
2. sets ``scheduler_config.scheduler_cls`` (``--scheduler-cls``) and ``parallel_config.worker_cls``
   (``--worker-cls``) to the elastic subclasses of the classes the platform chose;
3. turns off vLLM's own extensible KV cache (``cache_config.enable_extensible_kv_cache``, 0.34+, on by
   default on CUDA), which reserves the KV cache's address space itself and sizes it once after warm-up:
   the elastic backend backs that range instead, and the two cannot both own it. A user who asked for it
   explicitly (``--enable-extensible-kv-cache``) is refused rather than overruled;
4. with sleep mode on and a host arena configured (``ELASTIC_KV_HOST_ARENA``), selects the ``elastic``
   sleep-mode backend (``model_config.sleep_mode_backend``), which keeps asleep weights there;
5. records the decision and a fresh engine instance token in ``additional_config``, which the engine core
   and every worker receive with the config;
6. registers the front end's clean-up at exit (:mod:`vllm_elastic_kv.frontend.exits`): vLLM SIGKILLs the
   engine's processes when it is stopped, so the front end removes what they could not.

Model features that are only known once the workers report their KV cache specs (several KV cache
groups, Mamba, MLA, ...) are checked by the scheduler at start-up (:mod:`vllm_elastic_kv.features`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from elastic_kv.errors import ConfigError
from elastic_kv.ranks import new_instance_name

from vllm_elastic_kv import compat
from vllm_elastic_kv.config import BACKEND_KEY, INSTANCE_KEY, OPTIONS_KEY, Backend, PluginConfig
from vllm_elastic_kv.frontend.exits import register_clean_up

__all__ = ["SCHEDULERS", "SPECULATIVE_METHODS", "WORKERS", "activate", "patch", "unsupported"]

logger = logging.getLogger(__name__)

# The platform's worker class -> our subclass of it.
WORKERS = {
    "vllm.v1.worker.gpu_worker.Worker": "vllm_elastic_kv.worker.gpu_worker.ElasticGPUWorker",
    "vllm.v1.worker.cpu_worker.CPUWorker": "vllm_elastic_kv.worker.cpu_worker.ElasticCPUWorker",
}
# async_scheduling -> our scheduler.
SCHEDULERS = {
    False: "vllm_elastic_kv.scheduler.scheduler.ElasticScheduler",
    True: "vllm_elastic_kv.scheduler.scheduler.ElasticAsyncScheduler",
}
# Speculative decoding methods served. N-gram drafts come from the tokens themselves (no KV of their own);
# a draft model's attention layers join the target's KV cache groups, so its KV lies in the same blocks.
# Either way the verified lookahead tokens take slots the admission bound counts (kv_cache_manager). EAGLE
# / MTP layers and Medusa heads are refused until an engine test proves them.
SPECULATIVE_METHODS = ("ngram", "draft_model")
# Executors whose workers all live on this host (the ranks protocol reaches them over local sockets).
_LOCAL_EXECUTORS = (None, "mp", "uni")


def unsupported(vllm_config: Any) -> list[str]:
    """Why the elastic backend cannot serve ``vllm_config`` (empty: it can), one phrase per feature."""
    reasons: list[str] = []
    sched, par, cache, model = (
        vllm_config.scheduler_config,
        vllm_config.parallel_config,
        vllm_config.cache_config,
        vllm_config.model_config,
    )
    if sched.scheduler_cls is not None and sched.scheduler_cls not in SCHEDULERS.values():
        reasons.append(f"a custom scheduler class (--scheduler-cls {sched.scheduler_cls})")
    if par.worker_cls not in WORKERS and par.worker_cls not in WORKERS.values():
        reasons.append(f"worker class {par.worker_cls} (elastic-kv knows {', '.join(WORKERS)})")
    if par.data_parallel_size > 1:
        reasons.append(f"data parallelism (--data-parallel-size {par.data_parallel_size})")
    backend = par.distributed_executor_backend
    if backend not in _LOCAL_EXECUTORS:
        reasons.append(
            f"executor {backend!r} (elastic-kv reaches the workers over local sockets: 'mp' or 'uni' only)"
        )
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        reasons.append("KV connectors (--kv-transfer-config)")
    if getattr(cache, "kv_offloading_size", None):
        reasons.append("KV offloading (--kv-offloading-size)")
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None and speculative.method not in SPECULATIVE_METHODS:
        reasons.append(
            "speculative decoding other than ngram or a draft model "
            f"(--speculative-config method {speculative.method!r})"
        )
    if getattr(model, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models (cross-attention KV cache)")
    return reasons


def activate(vllm_config: Any, plugin: PluginConfig, extensible_requested: bool = False) -> None:
    """Make ``vllm_config`` run with the elastic backend (see the module docstring); ConfigError if it
    cannot. ``extensible_requested``: the user set ``enable_extensible_kv_cache=True`` themselves.
    Idempotent: a config activated once is left as it is."""
    compat.accept()
    reasons = unsupported(vllm_config)
    if extensible_requested:
        reasons.append(
            "vLLM's extensible KV cache (--enable-extensible-kv-cache: both would back the KV cache's "
            "address range)"
        )
    if reasons:
        raise ConfigError(
            "--kv-cache-backend=elastic does not support " + "; ".join(reasons) + ". Remove them, or use "
            "--kv-cache-backend=native."
        )
    if not isinstance(vllm_config.additional_config, dict):
        raise ConfigError(
            "--kv-cache-backend=elastic needs additional_config to be a dict, got "
            f"{type(vllm_config.additional_config).__name__}"
        )
    sched, par, cache = vllm_config.scheduler_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(cache, "enable_extensible_kv_cache", False):
        cache.enable_extensible_kv_cache = False  # vLLM does the same where a worker cannot back it
    if plugin.capacity_bytes and cache.kv_cache_memory_bytes is None:
        cache.kv_cache_memory_bytes = plugin.capacity_bytes  # virtual: backed only as blocks are used
    model = vllm_config.model_config
    arena = plugin.elastic.host_arena
    if model.enable_sleep_mode and arena is not None and model.sleep_mode_backend == "cumem":
        from vllm_elastic_kv import SLEEP_BACKEND

        model.sleep_mode_backend = (
            SLEEP_BACKEND  # asleep weights in the host arena (vllm_elastic_kv.worker.sleep)
        )
    sched.scheduler_cls = SCHEDULERS[bool(sched.async_scheduling)]
    par.worker_cls = WORKERS.get(par.worker_cls, par.worker_cls)
    options = dict(vllm_config.additional_config.get(OPTIONS_KEY, {}))
    fresh = INSTANCE_KEY not in options
    options.setdefault(INSTANCE_KEY, plugin.instance or new_instance_name())
    if fresh:  # this front end starts the engine: it cleans up after it (vllm_elastic_kv.frontend.exits)
        register_clean_up(options[INSTANCE_KEY], par.world_size, plugin.elastic.registry_dir)
    vllm_config.additional_config[BACKEND_KEY] = Backend.ELASTIC.value
    vllm_config.additional_config[OPTIONS_KEY] = options
    logger.info(
        "elastic KV cache enabled (from %s): scheduler %s, worker %s, instance %s",
        plugin.source,
        sched.scheduler_cls,
        par.worker_cls,
        options[INSTANCE_KEY],
    )


def _wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = original(self, *args, **kwargs)
        plugin = PluginConfig.from_vllm_config(vllm_config, os.environ)
        if plugin.enabled:
            activate(vllm_config, plugin, getattr(self, "enable_extensible_kv_cache", None) is True)
        return vllm_config

    return create_engine_config


def patch() -> compat.Patch:
    """The ``EngineArgs.create_engine_config`` wrapper (a pass-through for the native backend)."""
    return compat.Patch(
        "activation",
        compat.target(compat.ARG_UTILS, "EngineArgs.create_engine_config"),
        _wrap_create_engine_config,
    )
