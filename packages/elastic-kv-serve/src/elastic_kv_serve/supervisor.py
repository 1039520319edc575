"""The supervisor: starts, watches, restarts, sleeps and wakes every model's engine within two budgets.

It runs on the server's event loop. Its contract with the router is :meth:`Supervisor.admit`: an async
context manager that waits (bounded by ``wake_timeout_s``) until the model is awake -- waking it, making
room for it, starting it or waiting for its restart -- and has a free request slot (``max_in_flight``),
then counts the request in flight and yields the engine's URL. A request is refused only when the model's
wait queue is full (:class:`QueueFull`, HTTP 429), its wait times out, it was given up on
(``max_restarts`` failures in a row) or the server stops (:class:`ModelUnavailable`, HTTP 503); both say
when to retry.

Device memory: the awake models' weights plus every pool's KV stay within ``[server] budget``. Waking or
starting a model needs its weights plus the KV it held when idle; when that does not fit, idle models are
put to sleep first (:func:`elastic_kv_serve.policy.choose_victims`), and while none can go the request
waits for one to become idle. The device's KV budget is kept at *budget - weights of the models that
have room*, so a busy neighbour's KV never grows into room made for a model that is still loading.

More models serving than fit (``[server] suspend_busy``): when no idle model can make room and a KV share
would fall below its floor, the waking model suspends serving ones (awake at least ``min_awake_s``): they
sleep with their requests kept in their engines (:meth:`EngineKind.can_suspend`). A suspended model wakes
again once room is free, or, after ``max_suspend_s``, by suspending in turn a model awake since before its
own suspension (:func:`elastic_kv_serve.policy.choose_suspensions`); a wake for new requests goes first.

Host memory: asleep weights stay within ``[server] host_budget`` (:mod:`elastic_kv_serve.host`): each sleep
is level 1 while the host arena has room for the model's weights, else level 2, else a stop.

A monitor task, every ``poll_s``, reads each model's KV and host bytes, restarts dead engines with
back-off (also asleep ones: their next request cold-starts them), puts idle models to sleep and keeps the
device's KV budget. Engines start ``start_parallel`` at a time; with ``preload`` every model is started
at start-up and the ones that do not fit awake go to sleep, so that their first request is a wake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from elastic_kv.registry import UNLIMITED, LimitNotFollowedError, Registry, RegistryConfig, UnknownPoolError
from elastic_kv.sizes import Percent

from elastic_kv_serve import host, memory, policy
from elastic_kv_serve.config import ServeConfig
from elastic_kv_serve.engines import EngineDied, EngineProcess, EngineStartError, engine_env
from elastic_kv_serve.kinds import SleepMode, flag_values, kind_of
from elastic_kv_serve.metrics import ServeMetrics
from elastic_kv_serve.runtime import ModelRuntime, State

__all__ = ["ModelUnavailable", "QueueFull", "Supervisor", "UnknownModel"]

logger = logging.getLogger(__name__)


class UnknownModel(LookupError):
    """No model of that name is configured (HTTP 404)."""


class ModelUnavailable(RuntimeError):
    """The model cannot serve this request: its wait timed out, it was given up on, or the server is
    stopping (HTTP 503, with ``retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(ModelUnavailable):
    """The model already has ``max_queued`` requests waiting (HTTP 429, with ``retry_after_s``)."""


class _NoRoomYet(Exception):
    """A suspended model's wake found no room at once; it stays suspended and is tried again later."""


def _bytes_of(amount: int | Percent, whole: int) -> int:
    """An amount of the config in bytes: as given, or its percentage of ``whole``."""
    return amount if isinstance(amount, int) else amount.of(whole)


class Supervisor:
    """Every model of one :class:`ServeConfig` (see the module docstring)."""

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
        self.started_up = False  # every model that starts at start-up has started (or failed to)
        self._budget = memory.BudgetKeeper(self.registry)
        self._memory_lock = asyncio.Lock()  # one make-room decision at a time
        self._host_lock = asyncio.Lock()  # one sleep-level decision (and its sleep) at a time
        self._waiting_room: dict[str, ModelRuntime] = {}  # models waiting for room no idle model can make
        self._sharing = False  # the serving models' KV is shared now (policy: "KV shares")
        self._unshareable: set[str] = set()  # models whose pool took no limit (named parts, or refused)
        self._unsuspendable: set[str] = set()  # models whose engine refused a suspension (until a new start)
        self._undemotable: set[str] = set()  # models whose engine refused a demotion (until a new start)
        self._share_lock = asyncio.Lock()  # one shares decision at a time (the monitor and waiting wakes)
        self._starts = asyncio.Semaphore(srv.start_parallel)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._prepared = False
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_keepalive_connections=0)
        )
        self.metrics.bind(self)

    # ------------------------------------------------------------------ life cycle

    def prepare(self) -> None:
        """Before serving: decide each model's sleep mode from a probe of its engine's platform (one probe
        per engine and environment), then create the host arena if a model sleeps into it.
        :class:`EngineStartError` when an engine cannot be loaded at all, ``ConfigError`` for a host budget
        the host cannot give."""
        modes: dict[tuple[str, frozenset[tuple[str, str]], tuple[str, ...]], SleepMode] = {}
        for rt in self.models.values():
            env = engine_env(rt.config, self.registry.directory)
            devices = tuple(flag_values(rt.config.args, "--device"))
            key = (rt.config.engine, frozenset(rt.config.env.items()), devices)
            if key not in modes:
                try:
                    modes[key] = kind_of(rt.config).probe(rt.config, env)
                except RuntimeError as exc:
                    raise EngineStartError(str(exc)) from None
            rt.sleep_mode = modes[key]
            logger.info("model %s: engine %s, sleep mode %s", rt.name, rt.config.engine, rt.sleep_mode)
        if any(rt.sleep_mode == "engine" and kind_of(rt.config).uses_arena for rt in self.models.values()):
            self.host.create_arena()
        self._prepared = True

    async def start(self) -> None:
        """Start the models that fit (pinned first, then by priority; every model with ``preload``); the
        others stay asleep until asked for. Returns once the start-up is under way."""
        if not self._prepared:
            await asyncio.to_thread(self.prepare)
        self._monitor = asyncio.create_task(self._monitor_loop(), name="monitor")
        order = sorted(self.models.values(), key=lambda r: (not r.config.pinned, -r.config.priority))
        self._spawn(self._start_up(order), "start-up")

    async def _start_up(self, order: list[ModelRuntime]) -> None:
        if self.config.server.preload:
            # Lowest priority first: each later start may put the earlier, lower ones to sleep.
            starts = [self._bring_up(rt, State.STARTING, deadline=None) for rt in reversed(order)]
        else:
            starts = []
            for rt in order:
                if not policy.fits(rt.weights_bytes, self.used_bytes(), self.budget_bytes):
                    logger.info(
                        "model %s stays asleep: its weights do not fit the budget beside the others", rt.name
                    )
                    continue
                rt.has_room = True  # claimed now, so that the next model's fit counts it
                starts.append(self._bring_up(rt, State.STARTING, deadline=None))
        await asyncio.gather(*starts)
        self.started_up = True
        logger.info("start-up done: %s", ", ".join(f"{r.name} {r.state.value}" for r in self.models.values()))

    async def shutdown(self) -> None:
        """Stop every engine (in-flight requests are drained by the HTTP server before this is called),
        reclaim the registry, restore the device budgets, remove the host arena."""
        self.closing = True
        if self._monitor is not None:
            self._monitor.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._monitor is not None:
            await asyncio.gather(self._monitor, return_exceptions=True)

        async def stop(rt: ModelRuntime) -> None:
            if rt.engine is not None:
                await rt.engine.stop_async()
                rt.engine = None
            rt.set_state(State.STOPPED)

        await asyncio.gather(*(stop(rt) for rt in self.models.values()))
        await asyncio.to_thread(self.registry.reclaim)
        await asyncio.to_thread(self._budget.restore)
        self.host.close()
        await self.client.aclose()
        logger.info("all engines stopped")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """A spawned task ended: forget it, and log the error that ended it (nobody awaits it)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("task %s failed", task.get_name(), exc_info=task.exception())

    # ------------------------------------------------------------------ requests

    def model(self, name: str) -> ModelRuntime:
        try:
            return self.models[name]
        except KeyError:
            raise UnknownModel(name) from None

    @contextlib.asynccontextmanager
    async def admit(self, rt: ModelRuntime) -> AsyncIterator[str]:
        """Wait until ``rt`` is awake (waking or starting it if needed, or waiting for its restart), count the
        request in flight, yield its URL. :class:`QueueFull` or :class:`ModelUnavailable` otherwise."""
        srv = self.config.server
        if rt.queued >= srv.max_queued:
            raise QueueFull(f"model {rt.name} has {rt.queued} requests waiting already", retry_after_s=1)
        deadline = time.monotonic() + srv.wake_timeout_s
        slots = self.config.max_in_flight(rt.config)
        rt.queued += 1
        try:
            while True:
                if self.closing:
                    raise ModelUnavailable("the server is shutting down", retry_after_s=5)
                if rt.state is State.AWAKE and rt.engine is not None and (not slots or rt.in_flight < slots):
                    url = rt.engine.url
                    break
                if rt.state is State.STOPPED:
                    raise ModelUnavailable(
                        f"model {rt.name} is unavailable: {rt.error or 'stopped'}", retry_after_s=60
                    )
                if rt.state is State.ASLEEP:
                    self._spawn(self._bring_up(rt, State.WAKING, deadline), f"wake-{rt.name}")
                    rt.set_state(State.WAKING)  # claimed now: concurrent requests wait for this wake
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = (
                        f"serves {slots} requests at once and none ended"
                        if rt.state is State.AWAKE
                        else f"did not become ready ({rt.state.value})"
                    )
                    raise ModelUnavailable(
                        f"model {rt.name} {why} within {srv.wake_timeout_s:g} s",
                        retry_after_s=max(1, int(srv.wake_timeout_s / 10)),
                    )
                await rt.wait_change(remaining)
        finally:
            rt.queued -= 1
        rt.in_flight += 1
        try:
            yield url
        finally:
            rt.in_flight -= 1
            rt.touch()
            rt.notify()  # a request slot freed

    async def upstream_failed(self, rt: ModelRuntime) -> None:
        """The router lost a request to ``rt``'s engine: if the engine is dead, fail the model now (its
        restart starts at once) instead of at the monitor's next look. A dying process closes its sockets
        before it can be reaped, so this waits up to a second for the exit."""
        engine = rt.engine
        for _ in range(20):
            if engine is None or rt.engine is not engine or rt.state is not State.AWAKE:
                return
            if not engine.alive():
                await self._failed(rt, f"engine exited with {engine.proc.returncode}")
                return
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ transitions

    def used_bytes(self, exclude: ModelRuntime | None = None) -> int:
        """Weights of awake models plus every model's KV (what the budget covers)."""
        return sum(rt.footprint_bytes for rt in self.models.values() if rt is not exclude)

    async def _bring_up(
        self, rt: ModelRuntime, state: State, deadline: float | None, wait: bool = True
    ) -> None:
        """Start (``STARTING``) or wake (``WAKING``) ``rt``: make room, then wake its engine or cold-start it.
        Failures set ``FAILED`` and schedule a restart with back-off. ``wait=False`` (a suspended model's
        wake that no request waits for): only if room can be made at once, else it stays asleep."""
        t0 = time.monotonic()
        async with rt.lock:
            if rt.state is State.AWAKE or self.closing:
                return
            rt.set_state(state)
            level = "cold"
            try:
                await self._make_room(rt, deadline, wait)
                room_s = time.monotonic() - t0
                engine = rt.engine
                if engine is not None and engine.alive() and rt.sleep_level is not None:
                    level = str(rt.sleep_level)
                    wake = kind_of(rt.config).wake(self.client, engine.url, rt.config, rt.sleep_level)
                    await engine.while_alive(self.client, wake, f"wake from level {level}")
                else:
                    await self._cold_start(rt)
            except ModelUnavailable as exc:  # no room in time: it stays asleep, nothing failed
                rt.has_room = False
                self._sync_budget()
                rt.set_state(State.ASLEEP, str(exc))
                return
            except _NoRoomYet:
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
                self.metrics.wake_seconds.labels(rt.name, rt.sleep_mode, level).observe(took)
            rt.sleep_level = None
            rt.suspended = False
            rt.failures = 0
            rt.start_cause = None
            rt.touch()
            rt.awake_since = time.monotonic()
            rt.set_state(State.AWAKE)
            await self._refresh_host()
            self._sync_budget()
            logger.info("model %s is awake (%s, %s, in %.2f s)", rt.name, state.value, level, took)

    async def _cold_start(self, rt: ModelRuntime) -> None:
        async with self._starts:
            if rt.engine is not None:
                rt.engine.kill()
                rt.engine = None
                await self._reclaim()
            arena = self.host.arena.path if self.host.arena is not None else None
            env = engine_env(rt.config, self.registry.directory, host_arena=arena)
            rt.engine = EngineProcess.spawn(rt.config, rt.sleep_mode, env, self.log_dir)
            rt.kv_limit_bytes = None  # a new pool starts without a limit, and may take one
            rt.suspended = False  # a new process: whatever the old one kept is gone
            self._unshareable.discard(rt.name)
            self._unsuspendable.discard(rt.name)
            self._undemotable.discard(rt.name)
            try:
                await rt.engine.wait_healthy(self.client, self.config.server.start_timeout_s)
                if rt.sleep_mode == "engine":
                    need = await kind_of(rt.config).after_start(self.client, rt.engine.url, arena is not None)
                    rt.host_need_bytes = need or rt.host_need_bytes
            except BaseException:
                rt.engine.kill()
                await self._reclaim()
                raise

    async def _reclaim(self) -> None:
        """Give back what dead engines held: pool records and budget charges, host arena extents."""
        await asyncio.to_thread(self.registry.reclaim)
        await asyncio.to_thread(self.host.reclaim_dead)

    async def _make_room(self, rt: ModelRuntime, deadline: float | None, wait: bool = True) -> None:
        """Put idle models to sleep (or suspend serving ones) until ``rt``'s weights and idle KV fit the
        budget; wait for models to become idle while none can go; ``ModelUnavailable`` at the deadline.
        ``wait=False``: :class:`_NoRoomYet` instead of waiting (also while another model makes room)."""
        need = rt.weights_bytes + rt.idle_kv_bytes
        if not wait and self._memory_lock.locked():
            raise _NoRoomYet
        async with self._memory_lock:
            rt.has_room = False  # a claim made at start-up is made again here, against what holds now
            try:
                await self._make_room_locked(rt, need, deadline, wait)
            finally:
                self._waiting_room.pop(rt.name, None)
            # The newcomer's weights leave the budget before it loads, so neighbours' KV cannot take them.
            rt.has_room = True
            self._sync_budget()

    async def _make_room_locked(
        self, rt: ModelRuntime, need: int, deadline: float | None, wait: bool
    ) -> None:
        """`_make_room` under the memory lock: sleep idle victims, suspend serving ones (where KV shares
        cannot make room), or wait (sharing the serving models' KV with ``rt``)."""
        while True:
            used = self.used_bytes(exclude=rt)
            candidates = self._awake_candidates(exclude=rt)
            victims = policy.choose_victims(
                candidates, need_bytes=need, used_bytes=used, budget_bytes=self.budget_bytes,
                for_priority=rt.config.priority,
            )  # fmt: skip
            if victims is not None:
                for victim in victims:
                    logger.info("model %s sleeps to make room for %s", victim.name, rt.name)
                    await self._sleep(self.models[victim.name], reason=f"room for {rt.name}")
                if not victims or policy.fits(need, self.used_bytes(exclude=rt), self.budget_bytes):
                    return
            elif self.config.server.suspend_busy and not (wait and self._shares_make_room(rt)):
                busy = policy.choose_suspensions(
                    self._awake_candidates(exclude=rt, suspendable=True), need_bytes=need, used_bytes=used,
                    budget_bytes=self.budget_bytes, for_priority=rt.config.priority,
                    awake_before=self._awake_before(rt, wait),
                )  # fmt: skip
                if busy:
                    for victim in busy:
                        await self._suspend(self.models[victim.name], for_model=rt)
                    if policy.fits(need, self.used_bytes(exclude=rt), self.budget_bytes):
                        return
            if not wait:
                raise _NoRoomYet
            if deadline is not None and time.monotonic() >= deadline:
                raise ModelUnavailable(
                    f"no memory for model {rt.name}: every model holding it is busy or pinned"
                )
            if victims is None and rt.name not in self._waiting_room:
                self._waiting_room[rt.name] = rt  # the serving models' KV is shared with it
                await self._share_kv()
            await asyncio.sleep(self.poll_s)
            await self._refresh_kv()

    def _awake_candidates(
        self, exclude: ModelRuntime | None = None, suspendable: bool = False
    ) -> list[policy.Candidate]:
        """The awake models as the policy sees them; ``suspendable``: also whether each can be suspended."""
        return [
            policy.Candidate(
                o.name, o.config.priority, o.last_used, o.footprint_bytes, o.config.pinned, o.busy,
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
            and rt.name not in self._unsuspendable
            and kind.can_suspend(rt.config)
            and self.host.level_for(kind, rt.config, rt.level_one_bytes) != 0
        )

    def _awake_before(self, rt: ModelRuntime, wait: bool) -> float:
        """Models awake since this monotonic time or earlier may be suspended for ``rt``: ``min_awake_s``
        ago for a wake that requests wait for; for a suspended model's own wake (``wait=False``), only once
        it has been suspended ``max_suspend_s``, and then only models awake since before its suspension."""
        srv = self.config.server
        now = time.monotonic()
        if wait:
            return now - srv.min_awake_s
        if now - rt.suspended_since < srv.max_suspend_s:
            return -math.inf
        return min(now - srv.min_awake_s, rt.suspended_since)

    async def _suspend(self, rt: ModelRuntime, for_model: ModelRuntime) -> None:
        """Put a serving model to sleep with its requests kept in its engine (they resume when it wakes).
        An engine that refuses is woken again if needed, keeps serving and is not suspended again until it
        restarts; one that cannot be woken then has failed."""
        engine = rt.engine
        if rt.state is not State.AWAKE or engine is None:
            return
        rt.set_state(State.SLEEPING)
        t0 = time.monotonic()
        kind = kind_of(rt.config)
        async with self._host_lock:
            await self._arena_room_for(rt)
            level = self.host.level_for(kind, rt.config, rt.level_one_bytes)
            if not level:  # the host arena filled since the choice: a stop would lose its requests
                rt.set_state(State.AWAKE)
                return
            try:
                suspend = kind.sleep(self.client, engine.url, rt.config, level, keep=True)
                await engine.while_alive(self.client, suspend, f"sleep at level {level} keeping its requests")
            except httpx.HTTPError as exc:
                logger.warning("model %s was not suspended for %s: %s", rt.name, for_model.name, exc)
                self._unsuspendable.add(rt.name)
                try:
                    wake = kind.wake(self.client, engine.url, rt.config, level)
                    await engine.while_alive(self.client, wake, f"wake from level {level}")
                except httpx.HTTPError as wake_exc:
                    await self._failed(rt, f"wake after a refused suspension failed: {wake_exc}")
                    return
                rt.set_state(State.AWAKE)
                return
            rt.sleep_level = level
            await self._refresh_host()
            if level == 1 and kind.uses_arena and rt.host_bytes:
                rt.host_need_bytes = rt.host_bytes
        took = time.monotonic() - t0
        rt.record("suspend", str(level), took)
        self.metrics.sleep_seconds.labels(rt.name, str(level)).observe(took)
        rt.suspended = True
        rt.suspended_since = time.monotonic()
        rt.set_state(State.ASLEEP)
        await self._refresh_kv()
        self._sync_budget()
        logger.info(
            "model %s is suspended for %s (level %d, %.2f s; %d requests kept)",
            rt.name, for_model.name, level, took, rt.in_flight,
        )  # fmt: skip

    async def _sleep(self, rt: ModelRuntime, reason: str) -> None:
        """Put an awake, idle model to sleep: through its engine at the level host memory allows
        (:meth:`elastic_kv_serve.host.HostMemory.level_for`), or by stopping its process."""
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
                level = self.host.level_for(kind, rt.config, rt.level_one_bytes)
            try:
                if level and rt.engine is not None:
                    sleep = kind.sleep(self.client, rt.engine.url, rt.config, level)
                    await rt.engine.while_alive(self.client, sleep, f"sleep at level {level}")
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
                await self._reclaim()
            await self._refresh_host()
            if level == 1 and kind.uses_arena and rt.host_bytes:
                rt.host_need_bytes = rt.host_bytes
        took = time.monotonic() - t0
        rt.record("sleep", str(level) if level else "stop", took)
        self.metrics.sleep_seconds.labels(rt.name, str(level) if level else "stop").observe(took)
        rt.set_state(State.ASLEEP)
        await self._refresh_kv()
        self._sync_budget()
        logger.info(
            "model %s is asleep (%s, %s, %.2f s)",
            rt.name,
            reason,
            f"level {level}" if level else "stopped",
            took,
        )

    async def _arena_room_for(self, rt: ModelRuntime) -> None:
        """Before ``rt`` sleeps (the host lock held): if its level-1 copy does not fit in the host arena,
        demote asleep level-1 models that come before it (:func:`elastic_kv_serve.policy.demotion_order`)
        to level 2 until it fits. A model whose wake or start is under way is left alone; an engine that
        refuses is not asked again until it restarts."""
        kind = kind_of(rt.config)
        need = rt.level_one_bytes
        if not kind.uses_arena or 1 not in kind.levels_for(rt.config):
            return
        if self.host.level_for(kind, rt.config, need) == 1:
            return
        asleep = {
            o.name: o
            for o in self.models.values()
            if o is not rt and o.state is State.ASLEEP and o.sleep_level == 1 and o.host_bytes > 0
            and o.engine is not None and o.name not in self._undemotable
            and kind_of(o.config).can_demote(o.config)
        }  # fmt: skip
        candidates = [
            policy.Candidate(o.name, o.config.priority, o.last_used, o.host_bytes, busy=o.busy)
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
                    demote = kind_of(other.config).demote(self.client, engine.url, other.config)
                    await engine.while_alive(self.client, demote, "demote to level 2")
                except httpx.HTTPError as exc:
                    logger.warning("model %s was not demoted to level 2: %s", other.name, exc)
                    self._undemotable.add(other.name)
                    continue
                other.sleep_level = 2
                took = time.monotonic() - t0
                other.record("demote", "2", took)
                await self._refresh_host()
            logger.info("model %s is demoted to level 2 (%.2f s) for %s", other.name, took, rt.name)
            if self.host.level_for(kind, rt.config, need) == 1:
                return

    async def _failed(self, rt: ModelRuntime, error: str, start_cause: str | None = None) -> None:
        """Mark ``rt`` failed, clean its engine up, restart it with back-off (up to ``max_restarts``; a start
        that failed with the same ``start_cause`` as the one before it is not retried)."""
        srv = self.config.server
        if rt.engine is not None:
            log = rt.engine.log_path
            rt.engine.kill()
            rt.engine = None
            error = f"{error} (log {log})"
        rt.sleep_level = None
        rt.suspended = False
        await self._reclaim()
        rt.failures += 1
        repeated = start_cause is not None and start_cause == rt.start_cause
        rt.start_cause = start_cause
        if repeated:
            error += "; it failed the same way twice: not restarted"
        logger.error("model %s failed: %s", rt.name, error)
        if repeated or rt.failures > srv.max_restarts or self.closing:
            rt.set_state(State.STOPPED, error)
            return
        rt.set_state(State.FAILED, error)
        delay = min(srv.restart_backoff_max_s, srv.restart_backoff_s * 2 ** (rt.failures - 1))
        self._spawn(self._restart(rt, delay), f"restart-{rt.name}")
        self._sync_budget()

    async def _restart(self, rt: ModelRuntime, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.closing or rt.state is not State.FAILED:
            return
        rt.restarts += 1
        self.metrics.restarts.labels(rt.name).inc()
        await self._bring_up(
            rt, State.STARTING, deadline=time.monotonic() + self.config.server.wake_timeout_s
        )

    # ------------------------------------------------------------------ monitor

    async def _monitor_loop(self) -> None:
        health_every = max(1, int(10.0 / self.poll_s))
        tick = 0
        while not self.closing:
            tick += 1
            try:
                await self._refresh_kv()
                await self._refresh_host()
                for rt in self.models.values():
                    engine = rt.engine
                    if engine is None or engine.alive():
                        if rt.state is State.AWAKE and engine is not None and tick % health_every == 0:
                            self._spawn(self._check_health(rt), f"health-{rt.name}")
                        continue
                    if rt.state is State.AWAKE:
                        await self._failed(rt, f"engine exited with {engine.proc.returncode}")
                    elif rt.state is State.ASLEEP and not rt.lock.locked():
                        await self._died_asleep(rt, engine)
                now = time.monotonic()
                awake = self._awake_candidates()
                for due in policy.due_to_sleep(awake, now):
                    rt = self.models[due.name]
                    if not rt.lock.locked():
                        self._spawn(self._idle_sleep(rt), f"sleep-{rt.name}")
                self._relieve_pressure(awake, now)
                self._resume_suspended()
                await self._share_kv()
                self._sync_budget()
            except Exception:
                logger.exception("monitor step failed")
            await asyncio.sleep(self.poll_s)

    async def _died_asleep(self, rt: ModelRuntime, engine: EngineProcess) -> None:
        """An asleep engine's process died: clean up after it; its next request cold-starts it."""
        logger.warning(
            "model %s: its asleep engine exited with %s (log %s); its next request starts it again",
            rt.name,
            engine.proc.returncode,
            engine.log_path,
        )
        engine.kill()
        rt.engine = None
        rt.sleep_level = None
        rt.suspended = False
        await self._reclaim()
        await self._refresh_host()

    async def _idle_sleep(self, rt: ModelRuntime, reason: str | None = None) -> None:
        async with rt.lock:
            await self._sleep(rt, reason=reason or f"idle {rt.idle_sleep_s:g} s")

    def _resume_suspended(self) -> None:
        """Try to wake the suspended model that has waited longest (one try at a time, and none while another
        model sleeps, wakes, starts or makes room: a wake that requests wait for goes first). A suspended
        model whose clients all left is merely asleep."""
        for rt in self.models.values():
            if rt.suspended and rt.state is State.ASLEEP and not rt.busy:
                rt.suspended = False
        if self._memory_lock.locked() or any(
            r.state in (State.SLEEPING, State.WAKING, State.STARTING) for r in self.models.values()
        ):
            return
        waiting = [
            r for r in self.models.values() if r.suspended and r.state is State.ASLEEP and not r.lock.locked()
        ]
        if waiting:
            rt = min(waiting, key=lambda r: r.suspended_since)
            rt.set_state(State.WAKING)  # claimed now, as a request's wake claims it
            self._spawn(self._bring_up(rt, State.WAKING, deadline=None, wait=False), f"resume-{rt.name}")

    def _relieve_pressure(self, awake: list[policy.Candidate], now: float) -> None:
        """A serving model's KV grows and has almost filled the budget: put the first idle model to sleep
        (one at a time: none is sleeping or waking now), so that it grows into its memory (:mod:`.policy`)."""
        if any(r.state in (State.SLEEPING, State.WAKING, State.STARTING) for r in self.models.values()):
            return
        window = max(self.config.server.pressure_idle_s, 4 * self.poll_s)
        if not any(r.busy and now - r.kv_grew_at <= window for r in self.models.values()):
            return  # no model serving is growing its KV: it needs no room
        victim = policy.pressure_victim(
            awake, used_bytes=self.used_bytes(), budget_bytes=self.budget_bytes,
            headroom_bytes=self.kv_headroom_bytes, now=now, min_idle_s=self.config.server.pressure_idle_s,
        )  # fmt: skip
        if victim is not None and not self.models[victim.name].lock.locked():
            rt = self.models[victim.name]
            self._spawn(self._idle_sleep(rt, "KV room for the models serving"), f"sleep-{rt.name}")

    async def _share_kv(self) -> None:
        """Set, move or lift the serving models' KV shares (:mod:`.policy`, "KV shares"): while models wait
        for room, or two or more serve with less than ``kv_headroom`` of the budget left, each serving model
        and each waiting one gets an equal share of the KV room; sharing ends when no model waits and at most
        one serves."""
        async with self._share_lock:
            await self._share_kv_locked()

    def _share_plan(self, waiting: list[ModelRuntime]) -> tuple[list[ModelRuntime], int | None]:
        """The serving models whose KV would be shared with ``waiting``, and each one's share (``None``: no
        budget, or the share falls below its floor)."""
        budget = self.budget_bytes
        top = max((w.config.priority for w in waiting), default=None)
        shared = [
            r for r in self.models.values()
            if r.state is State.AWAKE and r.busy and r.has_room and not r.config.pinned
            and r.name not in self._unshareable and (top is None or r.config.priority <= top)
        ]  # fmt: skip
        if budget is None or not shared:
            return shared, None
        weights = sum(r.weights_bytes for r in self.models.values() if r.has_room)
        fixed = sum(r.kv_bytes for r in self.models.values() if r not in shared)
        room = budget - weights - sum(w.weights_bytes for w in waiting) - fixed
        share = policy.kv_share(room, len(shared) + len(waiting))
        # Below kv_share_min a model's own requests may not fit its share (two such models would wait for
        # each other), below what a model holds idle it makes no room: wait for an idle neighbour, or take
        # turns (suspension).
        claimants = [*shared, *waiting]
        floor = policy.share_floor(
            self.kv_share_min_bytes, self.config.server.kv_share_min_weights,
            (r.weights_bytes for r in claimants), (r.idle_kv_bytes for r in claimants),
        )  # fmt: skip
        return shared, share if share >= floor else None

    def _shares_make_room(self, rt: ModelRuntime) -> bool:
        """Whether sharing the serving models' KV with ``rt`` (waiting) would make room for it."""
        waiting = list(self._waiting_room.values())
        _, share = self._share_plan(waiting if rt in waiting else [*waiting, rt])
        return share is not None

    async def _share_kv_locked(self) -> None:
        budget = self.budget_bytes
        waiting = list(self._waiting_room.values())
        shared, share = self._share_plan(waiting)
        if budget is None or (not waiting and len(shared) < 2):
            self._sharing = False
        elif waiting or budget - self.used_bytes() < self.kv_headroom_bytes:
            self._sharing = True
        limits = {r.name: share for r in shared} if self._sharing and share is not None else {}
        for rt in self.models.values():
            want = limits.get(rt.name)
            have = rt.kv_limit_bytes
            if want == have or (want and have and abs(want - have) * 32 < have):
                continue  # unchanged, or moved by less than 1/32: each change may preempt requests
            await asyncio.to_thread(self._set_kv_limit, rt, want)

    def _set_kv_limit(self, rt: ModelRuntime, limit: int | None) -> None:
        """Put ``rt``'s KV share on its pool (``None``: lift it)."""
        try:
            self.registry.set_limit(rt.config.pool_name, UNLIMITED if limit is None else limit)
        except UnknownPoolError:
            if limit is not None:  # no pool of that name: SGLang's hybrid pools come as named parts
                self._unshareable.add(rt.name)
            rt.kv_limit_bytes = None
            return
        except LimitNotFollowedError as exc:
            logger.warning("model %s: its KV is not shared: %s", rt.name, exc)
            self._unshareable.add(rt.name)
            rt.kv_limit_bytes = None
            return
        rt.kv_limit_bytes = limit
        if limit is None:
            logger.info("model %s: KV share lifted", rt.name)
        else:
            logger.info("model %s: KV share %d bytes (holds %d)", rt.name, limit, rt.kv_bytes)

    async def _check_health(self, rt: ModelRuntime) -> None:
        engine = rt.engine
        if engine is None or rt.state is not State.AWAKE:
            return
        for _ in range(3):
            if await engine.healthy(self.client, timeout_s=10.0):
                return
            if rt.engine is not engine or rt.state is not State.AWAKE:
                return
        async with rt.lock:
            if rt.engine is engine and rt.state is State.AWAKE:
                await self._failed(rt, "engine stopped answering /health")

    async def _refresh_kv(self) -> None:
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

    async def _refresh_host(self) -> None:
        """Each model's host bytes: its arena extents, or (engines keeping their own copies) its weights
        while asleep at level 1."""
        owners = self.host.by_owner()
        for rt in self.models.values():
            if kind_of(rt.config).uses_arena:
                rt.host_bytes = owners.get(rt.config.pool_name, 0)
            else:
                rt.host_bytes = rt.weights_bytes if rt.sleep_level == 1 else 0

    def _sync_budget(self) -> None:
        """Keep each device's KV budget at *budget - weights of the models that have room for them*."""
        if self.budget_bytes is None:
            return
        weights = sum(rt.weights_bytes for rt in self.models.values() if rt.has_room)
        self._budget.apply(self.devices, self.budget_bytes - weights)

    # ------------------------------------------------------------------ visibility

    def host_used_bytes(self) -> int:
        """Host memory asleep models' weights take (the arena's and the engines' own copies)."""
        return sum(rt.host_bytes for rt in self.models.values())

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
