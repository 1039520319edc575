"""Putting awake models to sleep within the host budget: an idle model's sleep (through its engine at the
level host memory allows -- :meth:`elastic_kv_serve.host.HostMemory.level_for` -- or by stopping its
process), a serving model's suspension (asleep with its requests kept in its engine), and the demotions of
asleep level-1 models to level 2 that give a model going to sleep room in the host arena
(:func:`elastic_kv_serve.policy.demotion_order`). One sleep-level decision, with its sleep, at a time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from elastic_kv_serve import policy
from elastic_kv_serve.engines import EngineDied
from elastic_kv_serve.fleet import Fleet
from elastic_kv_serve.kinds import kind_of
from elastic_kv_serve.runtime import ModelRuntime, State

__all__ = ["SleepMoves"]

logger = logging.getLogger(__name__)


class SleepMoves:
    """The sleeps of one :class:`Fleet`'s models (see the module docstring). ``failed`` marks a model failed
    (a suspension's engine that can be neither suspended nor woken again)."""

    def __init__(self, fleet: Fleet, failed: Callable[[ModelRuntime, str], Awaitable[None]]) -> None:
        self.fleet = fleet
        self._failed = failed
        self._host_lock = asyncio.Lock()  # one sleep-level decision (and its sleep) at a time

    async def idle_sleep(self, rt: ModelRuntime, reason: str | None = None) -> None:
        """Put ``rt`` to sleep under its lock (idle for its ``idle_sleep_s``, or ``reason``)."""
        async with rt.lock:
            await self.sleep(rt, reason=reason or f"idle {rt.idle_sleep_s:g} s")

    async def suspend(self, rt: ModelRuntime, for_model: ModelRuntime) -> None:
        """Put a serving model to sleep with its requests kept in its engine (they resume when it wakes).
        An engine that refuses is woken again if needed, keeps serving and is not suspended again until it
        restarts; one that cannot be woken then has failed."""
        fleet = self.fleet
        engine = rt.engine
        if rt.state is not State.AWAKE or engine is None:
            return
        rt.set_state(State.SLEEPING)
        t0 = time.monotonic()
        kind = kind_of(rt.config)
        async with self._host_lock:
            # the engine parks its KV there first (where it fits), then copies its weights at level 1
            await self._arena_room_for(rt, rt.kv_bytes)
            level = fleet.host.level_for(kind, rt.config, rt.level_one_bytes, parked_bytes=rt.kv_bytes)
            if not level:  # the host arena filled since the choice: a stop would lose its requests
                rt.set_state(State.AWAKE)
                return
            try:
                suspend = kind.sleep(fleet.client, engine.url, rt.config, level, keep=True)
                parked = await engine.while_alive(
                    fleet.client, suspend, f"sleep at level {level} keeping its requests"
                )
            except httpx.HTTPError as exc:
                logger.warning("model %s was not suspended for %s: %s", rt.name, for_model.name, exc)
                fleet.unsuspendable.add(rt.name)
                try:
                    wake = kind.wake(fleet.client, engine.url, rt.config, level)
                    await engine.while_alive(fleet.client, wake, f"wake from level {level}")
                except httpx.HTTPError as wake_exc:
                    await self._failed(rt, f"wake after a refused suspension failed: {wake_exc}")
                    return
                rt.set_state(State.AWAKE)
                return
            rt.sleep_level = level
            rt.parked_kv_bytes = parked
            await fleet.refresh_host()
            if level == 1 and kind.uses_arena and rt.host_bytes:
                rt.host_need_bytes = max(0, rt.host_bytes - parked)  # the weights' copy; the KV's is not kept
        took = time.monotonic() - t0
        rt.record("suspend", str(level), took, kept=rt.in_flight, parked=parked)
        fleet.metrics.sleep_seconds.labels(rt.name, str(level)).observe(took)
        rt.suspended = True
        rt.suspended_since = time.monotonic()
        rt.set_state(State.ASLEEP)
        await fleet.refresh_kv()
        fleet.sync_budget()
        logger.info(
            "model %s is suspended for %s (level %d, %.2f s; %d requests kept, %d bytes of KV parked)",
            rt.name, for_model.name, level, took, rt.in_flight, parked,
        )  # fmt: skip

    async def sleep(self, rt: ModelRuntime, reason: str) -> None:
        """Put an awake, idle model to sleep: through its engine at the level host memory allows
        (:meth:`elastic_kv_serve.host.HostMemory.level_for`), or by stopping its process."""
        fleet = self.fleet
        if rt.state is not State.AWAKE or rt.busy:
            return
        rt.idle_kv_bytes = rt.kv_bytes
        rt.set_state(State.SLEEPING)
        t0 = time.monotonic()
        kind = kind_of(rt.config)
        async with self._host_lock:
            level = 0
            died = False
            if rt.sleep_mode == "engine" and rt.engine is not None:
                await self._arena_room_for(rt)
                level = fleet.host.level_for(kind, rt.config, rt.level_one_bytes)
            try:
                if level and rt.engine is not None:
                    sleep = kind.sleep(fleet.client, rt.engine.url, rt.config, level)
                    await rt.engine.while_alive(fleet.client, sleep, f"sleep at level {level}")
                    rt.sleep_level = level
            except httpx.HTTPError as exc:
                logger.warning("model %s did not sleep (%s): stopping its engine", rt.name, exc)
                level = 0
                died = isinstance(exc, EngineDied)
            if not level and rt.engine is not None:
                if died:  # a server whose engine died may wait for its clients before it exits
                    rt.engine.kill()
                else:
                    await rt.engine.stop_async()
                rt.engine = None
                rt.sleep_level = None
                await fleet.reclaim()
            await fleet.refresh_host()
            if level == 1 and kind.uses_arena and rt.host_bytes:
                rt.host_need_bytes = rt.host_bytes
        took = time.monotonic() - t0
        rt.record("sleep", str(level) if level else "stop", took)
        fleet.metrics.sleep_seconds.labels(rt.name, str(level) if level else "stop").observe(took)
        rt.set_state(State.ASLEEP)
        await fleet.refresh_kv()
        fleet.sync_budget()
        logger.info(
            "model %s is asleep (%s, %s, %.2f s)",
            rt.name,
            reason,
            f"level {level}" if level else "stopped",
            took,
        )

    async def _arena_room_for(self, rt: ModelRuntime, extra: int = 0) -> None:
        """Before ``rt`` sleeps (the host lock held): if its level-1 copy (and ``extra`` bytes: the KV a
        suspension parks) does not fit in the host arena, demote asleep level-1 models that come before it
        (:func:`elastic_kv_serve.policy.demotion_order`) to level 2 until it fits. A model whose wake or
        start is under way is left alone; an engine that refuses is not asked again until it restarts."""
        fleet = self.fleet
        kind = kind_of(rt.config)
        if not kind.uses_arena or 1 not in kind.levels_for(rt.config):
            return
        if fleet.host.fits(extra, rt.level_one_bytes):
            return
        asleep = {
            o.name: o
            for o in fleet.models.values()
            if o is not rt and o.state is State.ASLEEP and o.sleep_level == 1 and o.host_bytes > 0
            and o.engine is not None and o.name not in fleet.undemotable
            and kind_of(o.config).can_demote(o.config)
        }  # fmt: skip
        candidates = [
            policy.Candidate(o.name, o.config.priority, o.last_used, o.host_bytes, requests=o.requests)
            for o in asleep.values()
        ]
        for chosen in policy.demotion_order(candidates, priority=rt.config.priority, last_used=rt.last_used):
            other = asleep[chosen.name]
            engine = other.engine
            if other.lock.locked() or other.state is not State.ASLEEP or engine is None:
                continue  # waking or starting now
            async with other.lock:
                t0 = time.monotonic()
                try:
                    demote = kind_of(other.config).demote(fleet.client, engine.url, other.config)
                    await engine.while_alive(fleet.client, demote, "demote to level 2")
                except httpx.HTTPError as exc:
                    logger.warning("model %s was not demoted to level 2: %s", other.name, exc)
                    fleet.undemotable.add(other.name)
                    continue
                other.sleep_level = 2
                took = time.monotonic() - t0
                other.record("demote", "2", took)
                await fleet.refresh_host()
            logger.info("model %s is demoted to level 2 (%.2f s) for %s", other.name, took, rt.name)
            if fleet.host.fits(extra, rt.level_one_bytes):
                return
