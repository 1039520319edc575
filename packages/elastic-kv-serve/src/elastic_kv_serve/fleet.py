"""Every model of one server and what the supervisor's parts share: the budgets, the registry, host memory,
the HTTP client to the engines, the background tasks, and the readings taken from them -- each model's KV
and host bytes, the device's KV budget, the ``/status`` document.

:class:`Fleet` decides nothing: the parts that move models between states (:mod:`.wake`, :mod:`.sleep`,
:mod:`.room`, :mod:`.shares`) read and refresh it, and :class:`elastic_kv_serve.supervisor.Supervisor`
composes them over one fleet. It belongs to the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
from elastic_kv.registry import Registry, RegistryConfig
from elastic_kv.sizes import Percent

from elastic_kv_serve import host, memory, policy
from elastic_kv_serve.config import ServeConfig
from elastic_kv_serve.kinds import kind_of
from elastic_kv_serve.metrics import ServeMetrics
from elastic_kv_serve.runtime import ModelRuntime, State

__all__ = ["Fleet"]

logger = logging.getLogger(__name__)


def _bytes_of(amount: int | Percent, whole: int) -> int:
    """An amount of the config in bytes: as given, or its percentage of ``whole``."""
    return amount if isinstance(amount, int) else amount.of(whole)


class Fleet:
    """The models of one :class:`ServeConfig` and the state around them (see the module docstring)."""

    def __init__(self, config: ServeConfig, metrics: ServeMetrics | None = None, poll_s: float = 0.5) -> None:
        self.config = config
        srv = config.server
        self.registry = Registry(srv.registry_dir or RegistryConfig.from_env().directory)
        self.log_dir = Path(srv.log_dir or tempfile.mkdtemp(prefix="elastic-kv-serve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = memory.resolve_budget(srv.budget, srv.device_memory)
        self.kv_headroom_bytes = _bytes_of(srv.kv_headroom, self.budget_bytes or 0)
        self.kv_share_min_bytes = _bytes_of(srv.kv_share_min, self.budget_bytes or 0)
        self.host = host.HostMemory(
            host.resolve_host_budget(srv.host_budget, srv.host_memory),
            srv.host_arena_dir or self.registry.directory,
        )
        self.metrics = metrics or ServeMetrics()
        self.poll_s = poll_s
        self.models: dict[str, ModelRuntime] = {
            m.name: ModelRuntime(
                m,
                config.idle_sleep_s(m),
                m.weights_bytes if m.weights_bytes is not None else memory.checkpoint_bytes(m.model),
            )
            for m in config.models
        }
        self.devices: set[str] = set()
        self.closing = False
        # What each model's engine refused, not asked of it again until a new start of its process:
        self.unshareable: set[str] = set()  # a KV limit on its pool (named parts, or refused)
        self.unsuspendable: set[str] = set()  # a suspension
        self.undemotable: set[str] = set()  # a demotion to level 2
        self._budget = memory.BudgetKeeper(self.registry)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_keepalive_connections=0)
        )
        self.metrics.bind(self)

    # ------------------------------------------------------------------ background tasks

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``coro`` as a background task that :meth:`cancel_tasks` ends."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """A spawned task ended: forget it, and log the error that ended it (nobody awaits it)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def cancel_tasks(self) -> None:
        """Cancel every spawned task and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Once every engine stopped: reclaim the registry, restore the device budgets, remove the host
        arena, close the client."""
        await asyncio.to_thread(self.registry.reclaim)
        await asyncio.to_thread(self._budget.restore)
        self.host.close()
        await self.client.aclose()

    # ------------------------------------------------------------------ readings

    def used_bytes(self, exclude: ModelRuntime | None = None) -> int:
        """Weights of awake models plus every model's KV (what the budget covers)."""
        return sum(rt.footprint_bytes for rt in self.models.values() if rt is not exclude)

    def moving(self) -> bool:
        """Some model sleeps, wakes or starts now."""
        return any(rt.state in (State.SLEEPING, State.WAKING, State.STARTING) for rt in self.models.values())

    def host_used_bytes(self) -> int:
        """Host memory asleep models' weights take (the arena's and the engines' own copies)."""
        return sum(rt.host_bytes for rt in self.models.values())

    def awake_candidates(
        self, exclude: ModelRuntime | None = None, suspendable: bool = False
    ) -> list[policy.Candidate]:
        """The awake models as the policy sees them; ``suspendable``: also whether each can be suspended."""
        return [
            policy.Candidate(
                o.name, o.config.priority, o.last_used, o.footprint_bytes, o.config.pinned, o.requests,
                o.idle_sleep_s, o.awake_since, suspendable and self._suspendable(o),
            )
            for o in self.models.values()
            if o is not exclude and o.state is State.AWAKE
        ]  # fmt: skip

    def _suspendable(self, rt: ModelRuntime) -> bool:
        """Whether ``rt`` can sleep now keeping its requests: its engine can, and would not be stopped."""
        kind = kind_of(rt.config)
        return (
            rt.sleep_mode == "engine"
            and rt.engine is not None
            and rt.name not in self.unsuspendable
            and kind.can_suspend(rt.config)
            and self.host.level_for(kind, rt.config, rt.level_one_bytes) != 0
        )

    async def reclaim(self) -> None:
        """Give back what dead engines held: pool records and budget charges, host arena extents."""
        await asyncio.to_thread(self.registry.reclaim)
        await asyncio.to_thread(self.host.reclaim_dead)

    async def refresh_kv(self) -> None:
        """Each model's KV bytes from its pool records (and the devices they are on)."""
        pools = await asyncio.to_thread(self.registry.pools)
        charged = memory.kv_by_pool(pools)
        for rt in self.models.values():
            names = memory.pool_names(rt.config.pool_name)
            kv = sum(charged[n][0] for n in names if n in charged)
            if kv > rt.kv_bytes:
                rt.kv_grew_at = time.monotonic()
            rt.kv_bytes = kv
            self.devices.update(charged[n][1] for n in names if n in charged)
            if rt.state is State.AWAKE and not rt.busy:
                rt.idle_kv_bytes = rt.kv_bytes

    async def refresh_host(self) -> None:
        """Each model's host bytes: its arena extents, or (engines keeping their own copies) its weights
        while asleep at level 1."""
        owners = self.host.by_owner()
        for rt in self.models.values():
            if kind_of(rt.config).uses_arena:
                rt.host_bytes = owners.get(rt.config.pool_name, 0)
            else:
                rt.host_bytes = rt.weights_bytes if rt.sleep_level == 1 else 0

    def sync_budget(self) -> None:
        """Keep each device's KV budget at *budget - weights of the models that have room for them + KV
        parked in host memory by models that have none* (their pools stay charged for it)."""
        if self.budget_bytes is None:
            return
        weights = sum(rt.weights_bytes for rt in self.models.values() if rt.has_room)
        parked = sum(rt.kv_bytes - rt.device_kv_bytes for rt in self.models.values())
        self._budget.apply(self.devices, self.budget_bytes - weights + parked)

    def status(self) -> dict[str, Any]:
        """The ``/status`` document: the server's budgets and every model's entry."""
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes(),
            "host_budget_bytes": self.host.budget_bytes,
            "host_used_bytes": self.host_used_bytes(),
            "host_arena": str(self.host.arena.path) if self.host.arena is not None else None,
            "devices": sorted(self.devices),
            "registry_dir": str(self.registry.directory),
            "log_dir": str(self.log_dir),
            "closing": self.closing,
            "models": [rt.status() for rt in self.models.values()],
        }
