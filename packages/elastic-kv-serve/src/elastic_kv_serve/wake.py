"""Bringing a model up: making room for it (:mod:`.room`), then waking its asleep engine at the level it
slept at, or cold-starting its process (``start_parallel`` starts at a time). A wake that no room came for
in time leaves the model asleep; an engine that fails to start or wake fails the model (the supervisor
restarts it). A suspended model is woken again, one at a time, once nothing else moves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Protocol

import httpx

from elastic_kv_serve.engines import EngineProcess, EngineStartError, engine_env
from elastic_kv_serve.errors import ModelUnavailable
from elastic_kv_serve.fleet import Fleet
from elastic_kv_serve.kinds import kind_of
from elastic_kv_serve.room import NoRoomYet, RoomMaker
from elastic_kv_serve.runtime import ModelRuntime, State

__all__ = ["WakeMoves"]

logger = logging.getLogger(__name__)


class _Failed(Protocol):
    def __call__(self, rt: ModelRuntime, error: str, start_cause: str | None = None) -> Awaitable[None]: ...


class WakeMoves:
    """The starts and wakes of one :class:`Fleet`'s models (see the module docstring). ``failed`` marks a
    model failed (``start_cause``: why its engine could not start, if known)."""

    def __init__(self, fleet: Fleet, room: RoomMaker, failed: _Failed) -> None:
        self.fleet = fleet
        self.room = room
        self._failed = failed
        self._starts = asyncio.Semaphore(fleet.config.server.start_parallel)
        self._resuming = False  # a try to wake the suspended models is under way

    async def bring_up(
        self, rt: ModelRuntime, state: State, deadline: float | None, wait: bool = True
    ) -> None:
        """Start (``STARTING``) or wake (``WAKING``) ``rt``: make room, then wake its engine or cold-start it.
        Failures set ``FAILED`` and schedule a restart with back-off. ``wait=False`` (a suspended model's
        wake that no request waits for): only if room can be made at once, else it stays asleep."""
        fleet = self.fleet
        t0 = time.monotonic()
        async with rt.lock:
            if rt.state is State.AWAKE or fleet.closing:
                return
            rt.set_state(state)
            level = "cold"
            try:
                await self.room.make_room(rt, deadline, wait)
                room_s = time.monotonic() - t0
                engine = rt.engine
                if engine is not None and engine.alive() and rt.sleep_level is not None:
                    level = str(rt.sleep_level)
                    wake = kind_of(rt.config).wake(fleet.client, engine.url, rt.config, rt.sleep_level)
                    await engine.while_alive(fleet.client, wake, f"wake from level {level}")
                else:
                    await self._cold_start(rt)
            except ModelUnavailable as exc:  # no room in time: it stays asleep, nothing failed
                rt.has_room = False
                fleet.sync_budget()
                rt.set_state(State.ASLEEP, str(exc))
                return
            except NoRoomYet:
                rt.set_state(State.ASLEEP)
                return
            except EngineStartError as exc:
                await self._failed(rt, f"EngineStartError: {exc}", start_cause=exc.cause)
                return
            except httpx.HTTPError as exc:
                await self._failed(rt, f"{type(exc).__name__}: {exc}".splitlines()[0])
                return
            took = time.monotonic() - t0
            kind = "start" if state is State.STARTING else "resume" if rt.suspended else "wake"
            rt.record(kind, level, took, room_s)
            if kind != "start":
                fleet.metrics.wake_seconds.labels(rt.name, rt.sleep_mode, level).observe(took)
            rt.sleep_level = None
            rt.suspended = False
            rt.parked_kv_bytes = 0
            rt.failures = 0
            rt.start_cause = None
            rt.touch()
            rt.awake_since = time.monotonic()
            rt.set_state(State.AWAKE)
            await fleet.refresh_host()
            fleet.sync_budget()
            logger.info("model %s is awake (%s, %s, in %.2f s)", rt.name, state.value, level, took)

    async def _cold_start(self, rt: ModelRuntime) -> None:
        """Start a new engine process for ``rt`` (killing the one it had) and wait until it serves."""
        fleet = self.fleet
        async with self._starts:
            if rt.engine is not None:
                rt.engine.kill()
                rt.engine = None
                await fleet.reclaim()
            arena = fleet.host.arena.path if fleet.host.arena is not None else None
            env = engine_env(rt.config, fleet.registry.directory, host_arena=arena)
            rt.engine = EngineProcess.spawn(rt.config, rt.sleep_mode, env, fleet.log_dir)
            rt.kv_limit_bytes = None  # a new pool starts without a limit, and may take one
            rt.suspended = False  # a new process: whatever the old one kept is gone
            rt.parked_kv_bytes = 0
            fleet.unshareable.discard(rt.name)
            fleet.unsuspendable.discard(rt.name)
            fleet.undemotable.discard(rt.name)
            try:
                await rt.engine.wait_healthy(fleet.client, fleet.config.server.start_timeout_s)
                if rt.sleep_mode == "engine":
                    need = await kind_of(rt.config).after_start(
                        fleet.client, rt.engine.url, arena is not None
                    )
                    rt.host_need_bytes = need or rt.host_need_bytes
            except BaseException:
                rt.engine.kill()
                await fleet.reclaim()
                raise

    def resume_suspended(self) -> None:
        """Try to wake the suspended models, the one that has waited longest first, until one wakes: one that
        finds no room does not hold back the others behind it (one try at a time, and none while another
        model sleeps, wakes, starts or makes room: a wake that requests wait for goes first). A suspended
        model whose clients all left is merely asleep."""
        fleet = self.fleet
        for rt in fleet.models.values():
            if rt.suspended and rt.state is State.ASLEEP and not rt.busy:
                rt.suspended = False
        if self._resuming or self.room.lock.locked() or fleet.moving():
            return
        if any(r.suspended and r.state is State.ASLEEP for r in fleet.models.values()):
            self._resuming = True
            fleet.spawn(self._resume_first(), "resume")

    async def _resume_first(self) -> None:
        """:meth:`resume_suspended`'s tries, in the order the models were suspended."""
        fleet = self.fleet
        try:
            for rt in sorted(fleet.models.values(), key=lambda r: r.suspended_since):
                if fleet.closing or self.room.lock.locked():
                    return  # a wake that requests wait for goes first
                if not (rt.suspended and rt.state is State.ASLEEP and not rt.lock.locked()):
                    continue
                rt.set_state(State.WAKING)  # claimed now, as a request's wake claims it
                await self.bring_up(rt, State.WAKING, deadline=None, wait=False)
                if rt.state is State.AWAKE:
                    return
        finally:
            self._resuming = False
