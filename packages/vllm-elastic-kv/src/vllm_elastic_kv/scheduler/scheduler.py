"""Scheduler side: the ``--scheduler-cls`` subclasses the front end selects for the elastic backend.

``ElasticScheduler`` / ``ElasticAsyncScheduler`` are vLLM's ``Scheduler`` / ``AsyncScheduler`` (the front end
picks the one matching ``async_scheduling``). They change these things:

* construction: while vLLM's ``Scheduler.__init__`` runs, the names ``KVCacheManager`` (in vLLM's scheduler
  module) and ``BlockPool`` (in vLLM's coordinator module) are bound to the elastic subclasses, so vLLM's own
  construction code builds them with its own arguments (:func:`vllm_elastic_kv.compat.scoped_attribute`;
  restored when construction ends). Then the pool is connected to the ledger and the workers
  (:class:`~vllm_elastic_kv.scheduler.scheduler_pool.SchedulerPool`). Unsupported model features fail here.
* ``add_request``: the pool starts mapping what the new request's prompt needs, in the background;
* ``schedule``: first, while the pool is over a lowered limit, the requests holding blocks on the pages it
  releases are preempted (:mod:`vllm_elastic_kv.scheduler.drain`), and requests that need more than the pool's
  limit or budget lets a request hold end with an error (:mod:`vllm_elastic_kv.scheduler.fit`); while vLLM
  schedules the step, the pool counts only the blocks it holds (the running requests' fast path); a step that
  scheduled nothing for want of memory waits until something may have changed instead of spinning; after it,
  the step's release epoch starts and the pool does its housekeeping (reserve, ``kvctl`` limit; a decode step
  refills the reserve only below what decode steps take, see :mod:`elastic_kv.ledger.reserve`);
* ``_preempt_request``: every preemption (vLLM's own, or the limit's) is counted in the pool's record,
  where ``kvctl limit --wait`` reads what a limit cost;
* ``update_from_output``: pages emptied while that step could still read them are released now, and the
  outputs of the requests ended for not fitting are added; when no request is left (also after
  ``finish_requests`` or ``reset_prefix_cache``) the pool settles to the null block's page.

While the engine is idle, ``kvctl`` changes (trim, limit, budget) are applied by
:class:`~vllm_elastic_kv.scheduler.idle.IdleControl`, which wakes the engine core's loop to run them on its
thread.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_elastic_kv import compat
from vllm_elastic_kv.config import PluginConfig
from vllm_elastic_kv.features import check_model, describe_groups
from vllm_elastic_kv.scheduler.block_pool import ElasticBlockPool
from vllm_elastic_kv.scheduler.drain import drain_order, vacate_draining_pages
from vllm_elastic_kv.scheduler.fit import RequestFit, RequestNeeds, Stall
from vllm_elastic_kv.scheduler.idle import IdleControl, constructing_engine_core
from vllm_elastic_kv.scheduler.kv_cache_manager import ElasticKVCacheManager
from vllm_elastic_kv.scheduler.scheduler_pool import SchedulerPool

__all__ = ["ElasticAsyncScheduler", "ElasticScheduler", "ElasticSchedulerMixin"]

logger = logging.getLogger(__name__)

_EPOCH_ATTR = "_elastic_kv_epoch"


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int) -> Any:
    if name in kwargs:
        return kwargs[name]
    if position < len(args):
        return args[position]
    raise TypeError(f"the scheduler was constructed without {name}")


def keeps_requests(
    plugin: PluginConfig, support: compat.VersionSupport, kv_cache_dtype: str = "auto"
) -> bool:
    """Whether a sleep that keeps its requests (``mode=keep``) leaves them running for the worker to park
    their KV (``park_kv``). Only where their state on the device survives the sleep: vLLM keeps it (0.32 and
    later), or the plugin's sleep-mode backend copies it (``VersionSupport.sleep_state_tags``), which it
    is wherever a host arena is configured (:mod:`vllm_elastic_kv.worker.sleep`) -- and, on those versions,
    only with an unquantized KV cache: their wake-up zeroes a quantized one (``post_kv_cache_wake_up``),
    kept requests' blocks on the null block's page with it. Elsewhere they are preempted, as vLLM does, and
    ``park_kv`` is said to be ignored."""
    if not plugin.elastic.park_kv:
        return False
    if support.sleep_state_tags and (plugin.elastic.host_arena is None or kv_cache_dtype.startswith("fp8")):
        logger.warning(
            "ELASTIC_KV_PARK_KV ignored: vLLM %s discards the requests' state at a sleep, which the plugin "
            "keeps only with a host arena (ELASTIC_KV_HOST_ARENA) and an unquantized KV cache; a sleep "
            "preempts its requests",
            support.label,
        )
        return False
    return True


class ElasticSchedulerMixin:
    """Mixed in before vLLM's scheduler class; see the module docstring."""

    elastic_pool: SchedulerPool
    elastic_fit: RequestFit
    elastic_stall: Stall
    elastic_keeps_requests: bool
    kv_cache_manager: Any  # vLLM's

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = _argument(args, kwargs, "vllm_config", 0)
        kv_cache_config = _argument(args, kwargs, "kv_cache_config", 1)
        plugin = PluginConfig.from_vllm_config(vllm_config, os.environ)
        support = compat.support_for(compat.installed_version())
        check_model(kv_cache_config)
        logger.info("elastic KV cache groups: %s", describe_groups(kv_cache_config))
        with (
            compat.scoped_attribute(
                compat.target("vllm.v1.core.sched.scheduler", "KVCacheManager"), ElasticKVCacheManager
            ),
            compat.scoped_attribute(
                compat.target("vllm.v1.core.kv_cache_coordinator", "BlockPool"), ElasticBlockPool
            ),
        ):
            super().__init__(*args, **kwargs)
        compat.check_instance(self, "vllm.v1.core.sched.scheduler.Scheduler")
        pool = self.kv_cache_manager.block_pool
        if not isinstance(pool, ElasticBlockPool) or not isinstance(
            self.kv_cache_manager, ElasticKVCacheManager
        ):
            raise RuntimeError("vLLM built its KV cache manager without the elastic classes")
        self.elastic_pool = elastic = SchedulerPool(plugin, support, vllm_config, kv_cache_config, pool)
        self.elastic_keeps_requests = keeps_requests(plugin, support, vllm_config.cache_config.cache_dtype)
        elastic.ledger.drain_order = functools.partial(drain_order, self)
        needs = RequestNeeds(kv_cache_config, vllm_config.model_config.max_model_len)
        self.elastic_fit = RequestFit(
            needs, elastic.ledger, elastic.record.name, plugin.elastic.publish_interval_s
        )
        records = [share.record for share in elastic.shares]
        stall = Stall(elastic.ledger.outside_room, records, wakeable=False)

        def on_idle() -> bool:
            stalled = stall.stalled
            stall.end()
            elastic.apply_control_idle()
            return stalled  # its requests may run now: the engine has work

        # kvctl's changes reach an idle engine too (its loop blocks until a request arrives otherwise), and
        # so does room for a stalled scheduler's requests.
        elastic.idle_control = IdleControl.for_engine(
            constructing_engine_core(), records, on_idle, wake_when=stall.room_grew
        )
        stall.wakeable = elastic.idle_control is not None
        self.elastic_stall = stall

    def add_request(self, request: Any) -> None:
        """vLLM's ``add_request``; then the pool maps ahead for the prompt (see
        :meth:`~vllm_elastic_kv.scheduler.scheduler_pool.SchedulerPool.request_added`)."""
        super().add_request(request)  # type: ignore[misc]
        self.elastic_stall.end()
        self.elastic_pool.request_added(request.num_tokens)
        self.elastic_fit.request_added(request.num_tokens)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``schedule``, counting only the blocks the pool holds for its running requests (see
        :mod:`vllm_elastic_kv.scheduler.kv_cache_manager`), after vacating the pages a lowered limit releases
        and ending the requests that cannot fit under the pool's ceiling
        (:mod:`vllm_elastic_kv.scheduler.fit`); when it scheduled nothing for want of memory and no step is in
        flight, it first waits for a change (:class:`~vllm_elastic_kv.scheduler.fit.Stall`). The returned step
        carries its release epoch."""
        elastic = self.elastic_pool
        if elastic.ledger.draining:
            vacate_draining_pages(self)
        self.elastic_fit.observe(self)
        refusals = self.kv_cache_manager.refusals
        with elastic.block_pool.counting(backed_only=True):
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        tokens = output.total_num_scheduled_tokens
        manager = self.kv_cache_manager
        if not tokens and manager.refusals != refusals and not elastic.epochs.in_flight:
            pool = elastic.block_pool
            obtainable = pool.num_cached + elastic.ledger.available_size(fresh=True)
            # A request refused with every block it may hold free tries again at once, and then ends
            # (fit.RequestFit.refused_alone); any other refusal waits for room.
            refused, referenced = manager.last_refused, pool.num_referenced
            if not self.elastic_fit.refused_alone(refused, referenced, obtainable, elastic.steps):
                self.elastic_stall.begin()
                elastic.ledger.publish()  # kvctl sees the waiting requests' need while the loop waits
                if not self.elastic_stall.wakeable:
                    self.elastic_stall.wait()
        # A decode step (one token per scheduled request) leaves the GPU bound by memory bandwidth.
        light = 0 < tokens == len(output.num_scheduled_tokens)
        setattr(output, _EPOCH_ATTR, self.elastic_pool.step_dispatched(light))
        return output

    def has_requests(self) -> bool:
        """vLLM's ``has_requests``, except while the scheduler is stalled (:class:`.fit.Stall`) with no
        finished request left to report: then vLLM's engine loop waits for input as when idle."""
        if self.elastic_stall.stalled and not self.has_finished_requests():  # type: ignore[attr-defined]
            return False
        return bool(super().has_requests())  # type: ignore[misc]

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's ``_preempt_request``, counted in the pool's snapshot."""
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        self.elastic_pool.ledger.note_preempted()

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's ``update_from_output``, with the final outputs of the requests ended for not fitting; then
        pages the finished step could read may be released."""
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        outputs = self.elastic_fit.add_outputs(outputs)
        idle = not self.has_unfinished_requests()  # type: ignore[attr-defined]
        if idle:
            self.elastic_fit.went_idle()
        self.elastic_pool.step_completed(getattr(scheduler_output, _EPOCH_ATTR, None), idle)
        return outputs

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        """vLLM's ``reset_prefix_cache``; on success the pool returns its memory when idle, and this returns
        once it is free (``sleep`` resets the prefix cache to release the KV cache's memory).

        With ``park_kv`` (``elastic-kv serve`` sets it: its engines' weights never change while asleep) where
        the requests' state survives a sleep (:func:`keeps_requests`), paused keeping its requests (a sleep
        with ``mode=keep``), a reset that would preempt the running
        requests leaves them and their blocks alone: the worker's sleep parks their pages in host memory
        instead, and its wake-up brings them back (:mod:`vllm_elastic_kv.worker.parking`), so they go on
        where they were rather than being computed again. Only the empty reserve is returned here. Without
        it, vLLM's own behaviour: they are preempted, and computed again after the wake-up (with the weights
        as they are then)."""
        reset_running = bool(args[0] if args else kwargs.get("reset_running_requests", False))
        if (
            reset_running
            and self.elastic_keeps_requests
            and self.running  # type: ignore[attr-defined]
            and self.pause_state == PauseState.PAUSED_ALL  # type: ignore[attr-defined]
        ):
            self.elastic_stall.end()
            self.elastic_pool.settle_idle(wait=True)
            return True
        ok = bool(super().reset_prefix_cache(*args, **kwargs))  # type: ignore[misc]
        self.elastic_stall.end()
        if ok:
            self.elastic_pool.settle_idle(wait=True)
        return ok

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``finish_requests`` (aborts); if that left the engine idle, the pool settles."""
        result = super().finish_requests(*args, **kwargs)  # type: ignore[misc]
        self.elastic_stall.end()
        if not self.has_unfinished_requests():  # type: ignore[attr-defined]
            self.elastic_fit.went_idle()
            self.elastic_pool.settle_idle()
        return result

    def shutdown(self) -> None:
        """vLLM's ``shutdown``, then the pool's pages and record are returned."""
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            self.elastic_pool.close()


class ElasticScheduler(ElasticSchedulerMixin, Scheduler):
    """vLLM's ``Scheduler`` with the elastic KV cache (``async_scheduling`` off)."""


class ElasticAsyncScheduler(ElasticSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the elastic KV cache (``async_scheduling`` on)."""
