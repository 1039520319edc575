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
sleep with their requests kept in their engines (:meth:`EngineKind.can_suspend`), their KV parked in host
memory where the engine parks it (the device's KV budget is raised by it while they sleep, and their wake
needs room for it). A suspended model wakes
again once room is free, or, after ``max_suspend_s``, by suspending in turn a model awake at least as long
(:func:`elastic_kv_serve.policy.choose_suspensions`); a wake for new requests goes first.

Host memory: asleep weights stay within ``[server] host_budget`` (:mod:`elastic_kv_serve.host`): each sleep
is level 1 while the host arena has room for the model's weights, else level 2, else a stop.

A monitor task, every ``poll_s``, reads each model's KV and host bytes, restarts dead engines with
back-off (also asleep ones: their next request cold-starts them), puts idle models to sleep and keeps the
device's KV budget. Engines start ``start_parallel`` at a time; with ``preload`` every model is started
at start-up and the ones that do not fit awake go to sleep, so that their first request is a wake.

:class:`Supervisor` is the coordinator: it admits requests, starts and stops the server, restarts failed
engines and runs the monitor, over parts that share one :class:`elastic_kv_serve.fleet.Fleet` (the models,
budgets and readings): :mod:`.wake` (start and wake), :mod:`.sleep` (sleep, suspension, demotion),
:mod:`.room` (making room on the device) and :mod:`.shares` (KV shares).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from elastic_kv.sizes import format_bytes

from elastic_kv_serve import policy
from elastic_kv_serve.config import ServeConfig
from elastic_kv_serve.engines import EngineProcess, EngineStartError, engine_env
from elastic_kv_serve.errors import ModelUnavailable, QueueFull, UnknownModel
from elastic_kv_serve.fleet import Fleet
from elastic_kv_serve.kinds import SleepMode, flag_values, kind_of
from elastic_kv_serve.metrics import ServeMetrics
from elastic_kv_serve.room import RoomMaker
from elastic_kv_serve.runtime import ModelRuntime, State
from elastic_kv_serve.shares import KvShares
from elastic_kv_serve.sleep import SleepMoves
from elastic_kv_serve.wake import WakeMoves

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)


def _sleeps_into_arena(rt: ModelRuntime) -> bool:
    """Its engine sleeps through its own sleep mode, and its level-1 copy goes to the server's host arena."""
    return rt.sleep_mode == "engine" and kind_of(rt.config).uses_arena


class Supervisor:
    """Every model of one :class:`ServeConfig` (see the module docstring)."""

    def __init__(self, config: ServeConfig, metrics: ServeMetrics | None = None, poll_s: float = 0.5) -> None:
        self.config = config
        self.fleet = Fleet(config, metrics, poll_s)
        self.shares = KvShares(self.fleet)
        self.sleeps = SleepMoves(self.fleet, failed=self._failed)
        self.room = RoomMaker(self.fleet, self.sleeps, self.shares)
        self.wakes = WakeMoves(self.fleet, self.room, failed=self._failed)
        self.started_up = False  # every model that starts at start-up has started (or failed to)
        self._monitor: asyncio.Task[None] | None = None
        self._prepared = False

    # ------------------------------------------------------------------ life cycle

    def prepare(self) -> None:
        """Before serving: decide each model's sleep mode from a probe of its engine's platform (one probe
        per engine and environment), then create the host arena if a model sleeps into it.
        :class:`EngineStartError` when an engine cannot be loaded at all, ``ConfigError`` for a host budget
        the host cannot give."""
        fleet = self.fleet
        modes: dict[tuple[str, frozenset[tuple[str, str]], tuple[str, ...]], SleepMode] = {}
        for rt in fleet.models.values():
            env = engine_env(rt.config, fleet.registry.directory)
            devices = tuple(flag_values(rt.config.args, "--device"))
            key = (rt.config.engine, frozenset(rt.config.env.items()), devices)
            if key not in modes:
                try:
                    modes[key] = kind_of(rt.config).probe(rt.config, env)
                except RuntimeError as exc:
                    raise EngineStartError(str(exc)) from None
            rt.sleep_mode = modes[key]
            logger.info("model %s: engine %s, sleep mode %s", rt.name, rt.config.engine, rt.sleep_mode)
        if any(map(_sleeps_into_arena, fleet.models.values())):
            fleet.host.create_arena()
        self._prepared = True

    async def start(self) -> None:
        """Start the models that fit (pinned first, then by priority; every model with ``preload``); the
        others stay asleep until asked for. Returns once the start-up is under way."""
        if not self._prepared:
            await asyncio.to_thread(self.prepare)
        self._monitor = asyncio.create_task(self._monitor_loop(), name="monitor")
        order = sorted(self.fleet.models.values(), key=lambda r: (not r.config.pinned, -r.config.priority))
        self.fleet.spawn(self._start_up(order), "start-up")

    async def _start_up(self, order: list[ModelRuntime]) -> None:
        fleet = self.fleet
        if self.config.server.preload:
            # Lowest priority first: each later start may put the earlier, lower ones to sleep.
            starts = [self.wakes.bring_up(rt, State.STARTING, deadline=None) for rt in reversed(order)]
        else:
            starts = []
            for rt in order:
                if not policy.fits(rt.weights_bytes, fleet.used_bytes(), fleet.budget_bytes):
                    logger.info(
                        "model %s stays asleep: its weights do not fit the budget beside the others", rt.name
                    )
                    continue
                rt.has_room = True  # claimed now, so that the next model's fit counts it
                starts.append(self.wakes.bring_up(rt, State.STARTING, deadline=None))
        await asyncio.gather(*starts)
        self.started_up = True
        logger.info(
            "start-up done: %s", ", ".join(f"{r.name} {r.state.value}" for r in fleet.models.values())
        )
        self._check_arena()

    def _check_arena(self) -> None:
        """One warning when the host arena is too small for every swap to stay at level 1
        (:func:`elastic_kv_serve.policy.arena_shortfall`): the copies as the engines measured them, none for
        models that do not sleep into the arena."""
        fleet = self.fleet
        arena = fleet.host.arena
        if arena is None:
            return
        models = list(fleet.models.values())
        short = policy.arena_shortfall(
            arena.size, [r.level_one_bytes if _sleeps_into_arena(r) else 0 for r in models],
            [r.weights_bytes + r.idle_kv_bytes for r in models], fleet.budget_bytes,
        )  # fmt: skip
        if short:
            logger.warning(
                "server.host_budget: the host arena (%s) holds fewer level-1 copies than the models asleep "
                "when as many as fit are awake, plus the one a swap needs; some swaps will demote a model to "
                "level 2 (its next wake reloads its weights): %s more would keep every swap at level 1",
                format_bytes(arena.size), format_bytes(short),
            )  # fmt: skip

    async def shutdown(self) -> None:
        """Stop every engine (in-flight requests are drained by the HTTP server before this is called),
        reclaim the registry, restore the device budgets, remove the host arena."""
        self.fleet.closing = True
        if self._monitor is not None:
            self._monitor.cancel()
        await self.fleet.cancel_tasks()
        if self._monitor is not None:
            await asyncio.gather(self._monitor, return_exceptions=True)

        async def stop(rt: ModelRuntime) -> None:
            if rt.engine is not None:
                await rt.engine.stop_async()
                rt.engine = None
            rt.set_state(State.STOPPED)

        await asyncio.gather(*(stop(rt) for rt in self.fleet.models.values()))
        await self.fleet.close()
        logger.info("all engines stopped")

    # ------------------------------------------------------------------ requests

    def model(self, name: str) -> ModelRuntime:
        try:
            return self.fleet.models[name]
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
                if self.fleet.closing:
                    raise ModelUnavailable("the server is shutting down", retry_after_s=5)
                if rt.state is State.AWAKE and rt.engine is not None and (not slots or rt.in_flight < slots):
                    url = rt.engine.url
                    break
                if rt.state is State.STOPPED:
                    raise ModelUnavailable(
                        f"model {rt.name} is unavailable: {rt.error or 'stopped'}", retry_after_s=60
                    )
                if rt.state is State.ASLEEP:
                    self.fleet.spawn(self.wakes.bring_up(rt, State.WAKING, deadline), f"wake-{rt.name}")
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

    async def upstream_failed(self, rt: ModelRuntime) -> bool:
        """The router lost a request to ``rt``'s engine: if the engine is dead, fail the model now (its
        restart starts at once) instead of at the monitor's next look. A dying process closes its sockets
        before it can be reaped, so this waits up to a second for the exit. True when the engine is gone
        (dead, or already cleaned up by another request's failure): what it held died with it."""
        engine = rt.engine
        for _ in range(20):
            if engine is None or rt.engine is not engine:
                return True
            if not engine.alive():
                if rt.state is State.AWAKE:  # an engine asleep or suspended is the monitor's to clean up
                    await self._failed(rt, f"engine exited with {engine.proc.returncode}")
                return True
            await asyncio.sleep(0.05)
        return False

    # ------------------------------------------------------------------ failures

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
        rt.parked_kv_bytes = 0
        await self.fleet.reclaim()
        rt.failures += 1
        repeated = start_cause is not None and start_cause == rt.start_cause
        rt.start_cause = start_cause
        if repeated:
            error += "; it failed the same way twice: not restarted"
        logger.error("model %s failed: %s", rt.name, error)
        if repeated or rt.failures > srv.max_restarts or self.fleet.closing:
            rt.set_state(State.STOPPED, error)
            return
        rt.set_state(State.FAILED, error)
        delay = min(srv.restart_backoff_max_s, srv.restart_backoff_s * 2 ** (rt.failures - 1))
        self.fleet.spawn(self._restart(rt, delay), f"restart-{rt.name}")
        self.fleet.sync_budget()

    async def _restart(self, rt: ModelRuntime, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.fleet.closing or rt.state is not State.FAILED:
            return
        rt.restarts += 1
        self.fleet.metrics.restarts.labels(rt.name).inc()
        await self.wakes.bring_up(
            rt, State.STARTING, deadline=time.monotonic() + self.config.server.wake_timeout_s
        )

    # ------------------------------------------------------------------ monitor

    async def _monitor_loop(self) -> None:
        health_every = max(1, int(10.0 / self.fleet.poll_s))
        tick = 0
        while not self.fleet.closing:
            tick += 1
            try:
                await self.fleet.refresh_kv()
                await self.fleet.refresh_host()
                for rt in self.fleet.models.values():
                    engine = rt.engine
                    if engine is None or engine.alive():
                        if rt.state is State.AWAKE and engine is not None and tick % health_every == 0:
                            self.fleet.spawn(self._check_health(rt), f"health-{rt.name}")
                        continue
                    if rt.state is State.AWAKE:
                        await self._failed(rt, f"engine exited with {engine.proc.returncode}")
                    elif rt.state is State.ASLEEP and not rt.lock.locked():
                        await self._died_asleep(rt, engine)
                now = time.monotonic()
                awake = self.fleet.awake_candidates()
                for due in policy.due_to_sleep(awake, now):
                    rt = self.fleet.models[due.name]
                    if not rt.lock.locked():
                        self.fleet.spawn(self.sleeps.idle_sleep(rt), f"sleep-{rt.name}")
                self.room.relieve_pressure(awake, now)
                self.room.relieve_starvation(now)
                self.wakes.resume_suspended()
                await self.shares.share_kv()
                self.fleet.sync_budget()
            except Exception:
                logger.exception("monitor step failed")
            await asyncio.sleep(self.fleet.poll_s)

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
        rt.parked_kv_bytes = 0
        await self.fleet.reclaim()
        await self.fleet.refresh_host()

    async def _check_health(self, rt: ModelRuntime) -> None:
        engine = rt.engine
        if engine is None or rt.state is not State.AWAKE:
            return
        for _ in range(3):
            if await engine.healthy(self.fleet.client, timeout_s=10.0):
                return
            if rt.engine is not engine or rt.state is not State.AWAKE:
                return
        async with rt.lock:
            if rt.engine is engine and rt.state is State.AWAKE:
                await self._failed(rt, "engine stopped answering /health")
