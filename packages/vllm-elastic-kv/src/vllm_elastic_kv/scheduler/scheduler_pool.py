"""The scheduler's side of the elastic pool: the ledger, its shared record and the coordinator.

:class:`SchedulerPool` is built once the scheduler's block pool exists (the workers have allocated and
are serving their ranks by then) and wires:

* the **geometry** planned from the ``KVCacheConfig`` (:func:`vllm_elastic_kv.layout.pool_geometry`);
* the **coordinator** (``elastic_kv.ranks.Coordinator``) over the workers' ranks -- the handshake checks
  that every rank serves the same pages -- driven through a ``CoordinatorMapper``: the reserve is
  pre-mapped, and pages are released, on its background thread, so a step waits for the workers' driver
  only when it must map a page now. The transport: a direct call (``InProcessTransport``) when the one
  worker runs in this process (vLLM's ``UniProcExecutor``, the default for one GPU), else a
  ``SocketTransport`` to every worker's rank at ``socket_path(instance, rank)``;
* the pool's **records** in the shared registry (``kvctl list`` shows them; ``kvctl limit`` steers them):
  one per device its ranks back pages on, named by :func:`elastic_kv.device.device_key` (``cpu``, or
  the GPU's UUID), each charged for the ranks on its device (:func:`rank_devices`), and each carrying
  the device's memory size so that ``kvctl`` percentages work;
* the **ledger** (``elastic_kv.ledger.Ledger``) with ``defer_release``: a page emptied while a
  step that may read it is in flight is released only when that step's output is back.

Arrivals: :meth:`SchedulerPool.request_added` tells the ledger what the prompts that arrived since the last
step will need (:meth:`Ledger.expect`, bounded like the reserve), so a burst's first pages are
mapped in the background while the engine is still taking the burst in, not while its first step waits.

Epochs (:class:`StepEpochs`): :meth:`SchedulerPool.step_dispatched` after each ``schedule()`` starts an
epoch; :meth:`SchedulerPool.step_completed` when the scheduler processes that step's output releases pages
emptied up to it; :meth:`SchedulerPool.settle_idle` returns everything but the null block's page and the
minimum reserve (``reserve_min_pages``; nothing for sleep) when the engine goes idle (no step in flight).
Everything runs on the scheduler's thread, which owns the ledger.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

from elastic_kv.device import (
    DeviceKind,
    default_min_free_bytes,
    device_free_bytes,
    device_key,
    device_total_bytes,
)
from elastic_kv.ledger import Ledger
from elastic_kv.ranks import Coordinator, CoordinatorMapper, InProcessTransport, SocketTransport, Transport
from elastic_kv.registry import DeviceShare, create_shares

from vllm_elastic_kv.compat import VersionSupport
from vllm_elastic_kv.config import PluginConfig
from vllm_elastic_kv.layout import pool_geometry, reserve_min_pages
from vllm_elastic_kv.scheduler.block_pool import ElasticBlockPool
from vllm_elastic_kv.scheduler.idle import IdleControl
from vllm_elastic_kv.worker.worker_pool import local_rank

__all__ = ["SchedulerPool", "StepEpochs", "pool_name", "rank_devices"]

logger = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 120.0


def pool_name(vllm_config: Any) -> str:
    """A readable default pool name: ``vllm-<served model name>`` (registry-safe characters only)."""
    served = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = str(served or vllm_config.model_config.model).rstrip("/").rsplit("/", 1)[-1]
    return ("vllm-" + re.sub(r"[^A-Za-z0-9_.:-]", "_", name))[:48]


def rank_devices(vllm_config: Any) -> tuple[list[str], dict[str, int]]:
    """Each rank's device key, and each device's memory size.

    The workers of the executors the plugin accepts (``uni``, ``mp``: one host, no data parallelism) run
    rank ``r`` on the device of ordinal ``r`` as the engine core sees it (vLLM's ``cuda:<local_rank>``);
    the host backend has one device, ``cpu``. The driver answers without a context
    (:mod:`elastic_kv.device`), so the engine core takes no GPU memory for this.
    """
    from vllm.platforms import current_platform

    kind: DeviceKind = "cpu" if current_platform.is_cpu() else "hip" if current_platform.is_rocm() else "cuda"
    world = vllm_config.parallel_config.world_size
    keys = [device_key(kind, rank) for rank in range(world)]
    return keys, {key: device_total_bytes(kind, rank) for rank, key in enumerate(keys)}


def _free_per_rank(shares: list[DeviceShare], min_free: int) -> Callable[[], int]:
    """The ledger's ``physical_free`` for ranks on GPUs this process has no context on: NVML's free memory
    of every device, as one rank's bytes (the ledger keeps ``min_free`` free on each device)."""

    def free() -> int:
        rooms = []
        for share in shares:
            device_free = device_free_bytes(share.record.device)
            if device_free is not None:
                rooms.append(max(0, device_free - min_free) // share.ranks)
        # The ledger subtracts min_free from what this returns: add it back to the per-rank room.
        return min(rooms) + min_free if rooms else 1 << 62

    return free


def _transport(instance: str, world: int) -> Transport:
    """A direct call to the rank when the only worker runs in this process, else Unix sockets."""
    rank = local_rank(instance, 0) if world == 1 else None
    if rank is not None:
        return InProcessTransport([rank])
    return SocketTransport.for_instance(instance, world)


class StepEpochs:
    """When pages emptied by the scheduler may really be released (the async-scheduling barrier).

    The ledger runs with ``defer_release``: a page emptied in epoch ``E`` stays backed until
    ``release_through(E)``. Epoch ``E`` starts when step ``E`` is dispatched (after vLLM's ``schedule``
    allocated its blocks), so a page emptied while steps up to ``E`` may be in flight -- a preempted
    request's blocks during ``schedule``, a finished request's blocks in ``update_from_output`` of step
    ``E - 1`` while step ``E`` (scheduled before that output was seen, with the request still in it) runs
    -- carries ``E``, and is released only once step ``E``'s output has been processed, i.e. once the
    device work that may read it is over. Synchronous scheduling is the special case where no step is in
    flight when blocks are freed, so release is immediate.
    """

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.dispatched = 0  # epoch of the last step handed to the workers
        self.completed = 0  # epoch of the last step whose output the scheduler processed

    @property
    def in_flight(self) -> bool:
        """True while some dispatched step's output has not been processed."""
        return self.dispatched != self.completed

    def step_dispatched(self) -> int:
        """A step was scheduled: start its epoch and return it."""
        self.dispatched = self._ledger.advance_epoch()
        return self.dispatched

    def step_completed(self, epoch: int | None) -> None:
        """The output of the step of ``epoch`` was processed: release what only earlier work could read."""
        if epoch is not None:
            self.completed = max(self.completed, epoch)
        self._ledger.release_through(self.completed)

    def quiesce(self) -> bool:
        """Release every pending page if no step is in flight; False (nothing done) otherwise."""
        completed = self.completed
        if self.dispatched != completed:
            return False
        self._ledger.release_through(completed)
        return True


class SchedulerPool:
    """See the module docstring. ``pool`` is the scheduler's block pool; it is attached to the ledger."""

    def __init__(
        self,
        plugin: PluginConfig,
        support: VersionSupport,
        vllm_config: Any,
        kv_cache_config: Any,
        pool: ElasticBlockPool,
    ) -> None:
        from vllm.platforms import current_platform

        assert plugin.instance is not None
        self.plugin = plugin
        gpu = current_platform.is_cuda_alike()
        self.geometry = pool_geometry(
            kv_cache_config,
            vllm_config,
            support.kv_allocation,
            plugin.elastic,
            auto_page_size="page_size" not in plugin.chosen and gpu,
            split_kv=current_platform.is_rocm(),
        )
        self.reserve_min_pages = reserve_min_pages(
            plugin, vllm_config, kv_cache_config, self.geometry, gpu=gpu
        )
        devices, totals = rank_devices(vllm_config)
        min_free = plugin.elastic.min_free_bytes
        if gpu and "min_free_bytes" not in plugin.chosen:
            min_free = max((default_min_free_bytes(t) for t in totals.values()), default=0)
        cfg = dataclasses.replace(
            plugin.elastic,
            defer_release=True,
            page_size=self.geometry.page_size,
            reserve_min_pages=self.reserve_min_pages,
            min_free_bytes=min_free,
        )
        world = vllm_config.parallel_config.world_size
        self.transport = _transport(plugin.instance, world)
        self.coordinator = Coordinator(self.transport, handshake_timeout=_HANDSHAKE_TIMEOUT_S)
        if self.coordinator.num_pages != self.geometry.num_pages:
            raise RuntimeError(
                f"workers serve {self.coordinator.num_pages} pages, the scheduler planned "
                f"{self.geometry.num_pages}"
            )
        self.shares = create_shares(
            cfg.pool_name or pool_name(vllm_config),
            devices,
            engine="vllm",
            model=str(vllm_config.model_config.model),
            limit_bytes=cfg.limit_bytes,
            registry_dir=cfg.registry_dir,
            device_total_bytes=totals,
            suffix_if_taken=cfg.pool_name is None,
        )
        self.record = self.shares[0].record
        self.mapper = CoordinatorMapper(self.coordinator)
        self.ledger = Ledger(
            self.geometry,
            self.mapper,
            cfg,
            shares=self.shares,
            name=self.record.name,
            physical_free=_free_per_rank(self.shares, cfg.min_free_bytes) if gpu else None,
        )
        pool.attach(self.ledger)
        self.ledger.publish()  # kvctl shows the pool before its first step
        self.block_pool = pool
        self.idle_cache_pages = plugin.idle_cache_bytes // max(1, self.geometry.page_bytes)
        self.epochs = StepEpochs(self.ledger)
        self.idle_control: IdleControl | None = None
        self.steps = 0  # steps dispatched
        # ... of which the scheduler thread waited for the driver since the previous one: a map, or a
        # background map it needed
        self.driver_steps = 0
        self._waits_seen = 0
        # Blocks the prompts that arrived since the last step need (each KV cache group allocates its own).
        self._block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self._arriving = 0
        logger.info(
            "elastic KV pool %r: %s; %d rank(s), %s; limit %s",
            self.record.name,
            self.geometry.describe(),
            world,
            "called directly" if isinstance(self.transport, InProcessTransport) else "over Unix sockets",
            cfg.limit_bytes or "none",
        )

    # -- steps ------------------------------------------------------------------------------------------
    def _driver_waits(self) -> int:
        return self.mapper.calls + self.mapper.waits

    def request_added(self, num_tokens: int) -> None:
        """A request of ``num_tokens`` arrived: have the pages its prompt needs mapped ahead, in the
        background, with those of the others that arrived since the last step (a prefix-cache hit needs
        fewer; the ledger trims what no step takes)."""
        self._arriving += sum(-(-num_tokens // size) for size in self._block_sizes)
        self.ledger.expect(self._arriving)

    def step_dispatched(self, light: bool = False) -> int:
        """A step was scheduled (its blocks are allocated): start its epoch, do the step's housekeeping
        (``light``: a decode step, see :meth:`elastic_kv.ledger.Ledger.maintain`)."""
        if self.over_limit():
            # Memory must come back: whole pages of the prefix cache first (they hold nothing else);
            # pages of running requests follow as they finish or are preempted.
            self.block_pool.trim_cached()
        epoch = self.epochs.step_dispatched()
        self.ledger.maintain(light)
        self._arriving = 0
        self.steps += 1
        waits = self._driver_waits()
        if waits != self._waits_seen:
            self._waits_seen = waits
            self.driver_steps += 1
        return epoch

    def step_completed(self, epoch: int | None, idle: bool) -> None:
        """The output of the step of ``epoch`` was processed; ``idle``: no request is left."""
        if idle:
            self.block_pool.trim_cached(keep_pages=self.idle_cache_pages)
        self.epochs.step_completed(epoch)
        if idle:
            self.settle_idle()

    def settle_idle(self, wait: bool = False) -> None:
        """The engine has nothing left to run: once no step is in flight, release every pending page and
        the reserve but its minimum (``reserve_min_pages``, as while the engine runs: the next burst's
        first step finds them backed; 0 when the pool is over its limit) and publish the pool's state for
        ``kvctl``. ``wait`` (sleep, ``reset_prefix_cache``) releases the minimum reserve too.

        vLLM's engine loop blocks while idle and the ledger belongs to the scheduler's thread, so this runs
        at the transition to idle (last output processed, last request aborted, prefix cache reset, sleep)
        rather than on a timer; ``kvctl`` changes made while idle apply at the next step. The releases run
        behind, on the mapper's thread, so the step's last outputs do not wait for them; ``wait`` (sleep)
        returns only once the memory is free."""
        if not self.epochs.quiesce():
            return
        self.ledger.settle()
        keep = 0 if wait or self.over_limit() else self.reserve_min_pages
        self.ledger.trim(keep=keep)
        self.ledger.publish()
        self._waits_seen = self._driver_waits()  # waiting here held up no step: the engine is idle
        if wait:
            self.mapper.flush()

    def apply_control_idle(self) -> None:
        """``kvctl`` changed a record while the engine is idle (run on the scheduler's thread by
        :class:`~vllm_elastic_kv.scheduler.idle.IdleControl`): apply it now -- a trim returns the reserve, a
        limit below what is held drops the prefix cache's pages and the reserve -- and publish the result."""
        if not self.epochs.quiesce():
            return  # a step is in flight: its completion and the next steps apply the change
        self.ledger.settle()
        self.ledger.maintain()  # reads the change
        if self.over_limit():
            self.block_pool.trim_cached()
            self.epochs.quiesce()  # no step in flight: the emptied pages are released now
        self.ledger.publish()

    def over_limit(self) -> bool:
        """True while the pool holds more than its limit (``kvctl limit`` lowered it)."""
        return self.ledger.over_limit()

    def close(self) -> None:
        """Return the pool's record and charge (engine shutdown; idempotent).

        vLLM shuts the executor down before the scheduler, so the workers -- and with them every backed
        page -- are gone by now: nothing is unmapped from here."""
        steps = [self.mapper.close, self.transport.close, *(s.record.close for s in self.shares)]
        if self.idle_control is not None:
            steps.insert(0, self.idle_control.close)
        for step in steps:
            try:
                step()
            except Exception:  # shutdown continues
                logger.debug("elastic KV shutdown step %s failed", step, exc_info=True)
