"""Worker side: the ``--worker-cls`` subclasses the front end selects for the elastic backend.

vLLM allocates the KV cache inside ``Worker._maybe_get_memory_pool_context("kv_cache")`` (GPU and CPU
workers alike; the CPU worker inherits ``initialize_from_config``). The mixin overrides exactly that method
to hand vLLM the elastic allocation context, ``initialize_from_config`` to set the pool up around vLLM's
own code, and ``execute_model`` to order each step after the zeroing of newly mapped pages. Nothing else
of the worker changes: model loading, compilation, CUDA graphs, attention and sampling are vLLM's.
 Sleep and wake-up: the KV cache's physical memory is released on the scheduler side (``sleep`` pauses the
scheduler with ``clear_cache``, which resets the prefix cache: every block returns to the ledger, which unmaps
their pages and trims its reserve). The rest (weights, CUDA graphs) is vLLM's ``sleep``/``wake_up`` through
its sleep-mode backend (:mod:`vllm_elastic_kv.worker.sleep` where a host arena is configured), with one
change: vLLM ends ``sleep`` by asserting that the *device's* free memory did not fall, which other engines
sharing the GPU break whenever they grow their KV cache meanwhile. The sleep itself has completed by then,
so that one assertion is answered with a log line instead of failing the request.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from vllm_elastic_kv import compat
from vllm_elastic_kv.config import PluginConfig
from vllm_elastic_kv.features import attention_sink_layers, check_model, describe_groups
from vllm_elastic_kv.worker.worker_pool import WorkerPool

__all__ = ["ElasticWorkerMixin", "bound_kv_views"]

logger = logging.getLogger(__name__)

# The message of the device-wide free-memory assertion that ends vLLM's Worker.sleep (0.26 and 0.32).
_SLEEP_FREE_MEMORY_CHECK = "Memory usage increased after sleeping"


def bound_kv_views(vllm_config: Any, kv_cache_config: Any) -> list[torch.Tensor]:
    """The KV cache tensors vLLM bound to the layers of ``kv_cache_config`` (what the kernels read and
    write), from the compilation config's static forward context.

    An attention layer holds one tensor; a Mamba / linear-attention layer one per state (conv, SSM); vLLM
    0.26-0.28 wraps either in a list per virtual engine (one per worker in V1, also with pipeline
    parallelism, where each stage's worker holds only its own layers). Every tensor found counts: a state
    the geometry missed would be served by the zero page."""
    context = vllm_config.compilation_config.static_forward_context
    views: list[torch.Tensor] = []

    def collect(kv: Any) -> None:
        if isinstance(kv, torch.Tensor):
            views.append(kv)
        elif isinstance(kv, (list, tuple)):
            for item in kv:
                collect(item)

    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            collect(getattr(context.get(name), "kv_cache", None))
    return views


class ElasticWorkerMixin:
    """Mixed in before vLLM's worker class (see :mod:`vllm_elastic_kv.worker.gpu_worker` / ``cpu_worker``)."""

    _elastic_pool: WorkerPool | None = None
    # Provided by vLLM's worker:
    vllm_config: Any
    _sleep_saved_buffers: dict[str, torch.Tensor]  # the buffers its wake_up restores after a level-2 sleep

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """vLLM's ``initialize_from_config``, with the KV cache allocated in elastic spaces and served to the
        scheduler's coordinator afterwards."""
        compat.check_instance(self, "vllm.v1.worker.gpu_worker.Worker")
        plugin = PluginConfig.from_vllm_config(self.vllm_config, os.environ)
        support = compat.support_for(compat.installed_version())
        device, rank = getattr(self, "device"), getattr(self, "rank")  # noqa: B009 - set by vLLM's worker
        self._elastic_pool = WorkerPool(plugin, support, kv_cache_config, self.vllm_config, device, rank)
        if plugin.elastic.host_arena is not None and plugin.elastic.pool_name is not None:
            from vllm_elastic_kv.worker.sleep import set_owner

            set_owner(plugin.elastic.pool_name)
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
        check_model(kv_cache_config)
        self._elastic_pool.finish(bound_kv_views(self.vllm_config, kv_cache_config))

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager[Any]:
        """vLLM's context for ``tag``; for the KV cache, vLLM's context with the elastic allocation inside."""
        native = super()._maybe_get_memory_pool_context(tag)  # type: ignore[misc]
        pool = self._elastic_pool
        if tag != "kv_cache" or pool is None or pool.allocated:
            return native
        return _nested(native, pool)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``execute_model``, its kernels ordered after the zeroing of newly mapped pages (see
        :meth:`~vllm_elastic_kv.worker.worker_pool.WorkerPool.order_step`)."""
        pool = self._elastic_pool
        if pool is not None:
            pool.order_step()
        return super().execute_model(*args, **kwargs)  # type: ignore[misc]

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``sleep``, after the KV cache's mapped pages are parked in host memory where ``park_kv`` is
        set (what is mapped still holds requests the scheduler kept: :mod:`vllm_elastic_kv.worker.parking`);
        its closing device-wide free-memory check is not an error here (see the module docstring): the
        memory this engine released is released, whatever its neighbours allocated."""
        pool = self._elastic_pool
        if pool is not None and pool.parking is not None and pool.plugin.elastic.park_kv:
            pool.parking.park()
        try:
            super().sleep(level)  # type: ignore[misc]
        except AssertionError as exc:
            if _SLEEP_FREE_MEMORY_CHECK not in str(exc):
                raise
            logger.info(
                "asleep (level %d); the device's free memory fell meanwhile: other engines on this GPU "
                "allocated while this one slept",
                level,
            )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``wake_up``; with the KV cache's (every tag, or ``kv_cache``) the parked pages come back
        before the scheduler resumes."""
        super().wake_up(tags)  # type: ignore[misc]
        pool = self._elastic_pool
        if pool is not None and pool.parking is not None and (tags is None or "kv_cache" in tags):
            pool.parking.unpark()

    def elastic_kv_pin_host(self) -> dict[str, Any]:
        """Page-lock the whole host arena in this worker (``collective_rpc("elastic_kv_pin_host")``, which
        ``elastic-kv serve`` sends once an engine is up), so that no later sleep pays for pinning. Returns
        the bytes pinned, the seconds it took and the bytes of the arena a level-1 sleep of this worker
        would take (``level_one_bytes``: its weights, which ``elastic-kv serve`` plans the arena with); all
        0 without a host arena."""
        path = PluginConfig.from_vllm_config(self.vllm_config, os.environ).elastic.host_arena
        if path is None:
            return {"pinned_bytes": 0, "seconds": 0.0, "level_one_bytes": 0}
        from vllm_elastic_kv.worker.sleep import level_one_bytes, process_arena

        pinned = process_arena(path)
        seconds = pinned.pin_all()
        return {
            "pinned_bytes": pinned.pinned_bytes,
            "seconds": round(seconds, 3),
            "level_one_bytes": level_one_bytes(),
        }

    def elastic_kv_demote(self) -> dict[str, Any]:
        """Turn this engine's level-1 sleep in the host arena into a level-2 one
        (``collective_rpc("elastic_kv_demote")``, which ``elastic-kv serve`` sends to give the arena to a
        model used more recently; :meth:`vllm_elastic_kv.worker.sleep.ElasticSleepBackend.demote`): the extent
        goes back, the model's buffers are kept as vLLM's level-2 sleep keeps them, and the wake-up is level
        2's (``reload_weights`` between the weights' wake-up and the KV cache's). Returns the bytes given
        back. :class:`RuntimeError` where this worker cannot: not asleep in the arena, or this vLLM's level-2
        sleep would keep more than the buffers (a draft model; ``sleep_preserve_parameter_names``; from 0.34
        on, whatever ``reload_weights`` does not rewrite)."""
        from vllm_elastic_kv.worker.sleep import ElasticSleepBackend

        backend = getattr(self, "_sleep_mode_backend", None)
        if not hasattr(self, "_sleep_saved_buffers"):  # compat.PROBED
            raise RuntimeError("this vLLM's level-2 sleep keeps its own host copies: no demotion")
        if not isinstance(backend, ElasticSleepBackend):
            raise RuntimeError("not asleep through the elastic sleep-mode backend: nothing to demote")
        draft = getattr(self, "get_draft_model", None)
        if draft is not None and draft() is not None:
            raise RuntimeError("a level-2 sleep of a model with a draft model keeps its buffers too")
        if getattr(self.vllm_config.model_config, "sleep_preserve_parameter_names", None):
            raise RuntimeError("sleep_preserve_parameter_names: a level-2 sleep keeps those parameters too")
        extent = backend.extent_bytes
        model = getattr(self, "model_runner").model  # noqa: B009 - set by vLLM's worker
        self._sleep_saved_buffers = backend.demote(model.named_buffers())
        return {"freed_bytes": extent, "buffers": len(self._sleep_saved_buffers)}

    def elastic_kv_info(self) -> dict[str, Any]:
        """This worker's physical KV state (``LLM.collective_rpc("elastic_kv_info")``), with the model's KV
        cache groups, its attention layers with sinks and the layers that read another layer's cache."""
        pool = self._elastic_pool
        if pool is None:
            return {}
        context = self.vllm_config.compilation_config.static_forward_context
        return {
            **pool.info(),
            "kv_cache_groups": describe_groups(pool.kv_cache_config),
            "attention_sinks": attention_sink_layers(context),
            "shared_kv_layers": len(self._shared_kv_layers()),
        }

    def _shared_kv_layers(self) -> dict[str, str]:
        """vLLM's map of layers that reuse another layer's KV cache (cross-layer sharing) to that layer."""
        return getattr(getattr(self, "model_runner", None), "shared_kv_cache_layers", None) or {}

    def shutdown(self) -> None:
        """Stop serving the pool, then vLLM's own shutdown."""
        if self._elastic_pool is not None:
            self._elastic_pool.close()
        super().shutdown()  # type: ignore[misc]


@contextlib.contextmanager
def _nested(native: AbstractContextManager[Any], pool: WorkerPool) -> Iterator[None]:
    with native, pool.allocation():
        yield
