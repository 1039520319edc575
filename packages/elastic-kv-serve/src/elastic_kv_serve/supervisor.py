"""The supervisor: starts, watches, restarts, sleeps and wakes every model's engine within one budget.

It runs on the server's event loop. Its contract with the router is :meth:`Supervisor.admit`: an async
context manager that waits (bounded by ``wake_timeout_s``) until the model is awake -- waking it, and
making room for it, when it sleeps -- then counts the request in flight and yields the engine's URL.
Requests for a model whose engine failed get :class:`ModelUnavailable` at once (HTTP 503).

Memory: the awake models' weights plus every pool's KV stay within ``[server] budget``. Waking a model
needs its weights plus the KV it held when idle; when that does not fit, idle models are put to sleep
first (:func:`elastic_kv_serve.policy.choose_victims`). A monitor task, every ``poll_s``, reads each
model's KV bytes from the registry, restarts dead engines with back-off, puts idle models to sleep, and
keeps the device's KV budget at *budget - awake weights*.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from elastic_kv.registry import Registry, RegistryConfig

from elastic_kv_serve import memory, policy
from elastic_kv_serve.config import ServeConfig
from elastic_kv_serve.engines import (
    EngineProcess,
    EngineStartError,
    SleepMode,
    engine_env,
    flag_values,
    probe_sleep_mode,
)
from elastic_kv_serve.metrics import ServeMetrics
from elastic_kv_serve.runtime import ModelRuntime, State

__all__ = ["ModelUnavailable", "Supervisor", "UnknownModel"]

logger = logging.getLogger(__name__)

_SLEEP_API = {
    "vllm": ("/sleep?level=1", "/wake_up"),
    "sglang": ("/release_memory_occupation", "/resume_memory_occupation"),
}


class UnknownModel(LookupError):
    """No model of that name is configured (HTTP 404)."""


class ModelUnavailable(RuntimeError):
    """The model cannot serve now: its engine failed, it did not wake in time, or the server is stopping
    (HTTP 503)."""


class Supervisor:
    """Every model of one :class:`ServeConfig` (see the module docstring)."""

    def __init__(self, config: ServeConfig, metrics: ServeMetrics | None = None, poll_s: float = 0.5) -> None:
        self.config = config
        srv = config.server
        self.registry = Registry(srv.registry_dir or RegistryConfig.from_env().directory)
        self._own_log_dir = srv.log_dir is None
        self.log_dir = Path(srv.log_dir or tempfile.mkdtemp(prefix="elastic-kv-serve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = memory.resolve_budget(srv.budget, srv.device_memory)
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
        self._budget = memory.BudgetKeeper(self.registry)
        self._memory_lock = asyncio.Lock()  # one make-room decision at a time
        self._start_lock = asyncio.Lock()  # engines start one at a time (profiling, 2-core hosts)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._probed = False
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_keepalive_connections=0)
        )
        self.metrics.bind(self)

    # ------------------------------------------------------------------ life cycle

    def probe_sleep_modes(self) -> None:
        """Decide each model's sleep mode from a probe of its engine's platform (one probe per engine and
        environment); ``EngineStartError`` when an engine cannot be loaded at all."""
        modes: dict[tuple[str, frozenset[tuple[str, str]], tuple[str, ...]], SleepMode] = {}
        for rt in self.models.values():
            env = engine_env(rt.config, self.registry.directory)
            devices = tuple(flag_values(rt.config.args, "--device"))
            key = (rt.config.engine, frozenset(rt.config.env.items()), devices)
            if key not in modes:
                modes[key] = probe_sleep_mode(rt.config, env)
            rt.sleep_mode = modes[key]
            logger.info("model %s: engine %s, sleep mode %s", rt.name, rt.config.engine, rt.sleep_mode)
        self._probed = True

    async def start(self) -> None:
        """Start, one at a time, the models that fit (pinned first, then by priority); the others stay asleep
        until asked for. Returns once the start-up is under way."""
        if not self._probed:
            await asyncio.to_thread(self.probe_sleep_modes)
        self._monitor = asyncio.create_task(self._monitor_loop(), name="monitor")
        order = sorted(self.models.values(), key=lambda r: (not r.config.pinned, -r.config.priority))
        self._spawn(self._start_up(order), "start-up")

    async def _start_up(self, order: list[ModelRuntime]) -> None:
        for rt in order:
            if self.closing:
                return
            used = self.used_bytes()
            if not policy.fits(rt.weights_bytes, used, self.budget_bytes):
                logger.info(
                    "model %s stays asleep: its weights do not fit the budget beside the others", rt.name
                )
                continue
            await self._bring_up(rt, State.STARTING, deadline=None)

    async def shutdown(self) -> None:
        """Stop every engine (in-flight requests are drained by the HTTP server before this is called),
        reclaim the registry, restore the device budgets."""
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
                await rt.engine.stop()
                rt.engine = None
            rt.set_state(State.STOPPED)

        await asyncio.gather(*(stop(rt) for rt in self.models.values()))
        await asyncio.to_thread(self.registry.reclaim)
        await asyncio.to_thread(self._budget.restore)
        await self.client.aclose()
        logger.info("all engines stopped")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ requests

    def model(self, name: str) -> ModelRuntime:
        try:
            return self.models[name]
        except KeyError:
            raise UnknownModel(name) from None

    @contextlib.asynccontextmanager
    async def admit(self, rt: ModelRuntime) -> AsyncIterator[str]:
        """Wait until ``rt`` is awake (waking it if needed), count the request in flight, yield its URL."""
        deadline = time.monotonic() + self.config.server.wake_timeout_s
        rt.queued += 1
        try:
            while True:
                if self.closing:
                    raise ModelUnavailable("the server is shutting down")
                if rt.state is State.AWAKE and rt.engine is not None:
                    url = rt.engine.url
                    break
                if rt.state in (State.FAILED, State.STOPPED):
                    raise ModelUnavailable(f"model {rt.name} is unavailable: {rt.error or rt.state.value}")
                if rt.state is State.ASLEEP:
                    self._spawn(self._bring_up(rt, State.WAKING, deadline), f"wake-{rt.name}")
                    rt.set_state(State.WAKING)  # claimed now: concurrent requests wait for this wake
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ModelUnavailable(
                        f"model {rt.name} did not wake within {self.config.server.wake_timeout_s:.0f} s"
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

    async def upstream_failed(self, rt: ModelRuntime) -> None:
        """The router lost a request to ``rt``'s engine: if the engine is dead, fail the model now (its
        other requests get 503 at once) instead of at the monitor's next look. A dying process closes its
        sockets before it can be reaped, so this waits up to a second for the exit."""
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

    async def _bring_up(self, rt: ModelRuntime, state: State, deadline: float | None) -> None:
        """Start (``STARTING``) or wake (``WAKING``) ``rt``: make room, then wake its engine or cold-start it.
        Failures set ``FAILED`` and schedule a restart with back-off."""
        t0 = time.monotonic()
        async with rt.lock:
            if rt.state is State.AWAKE or self.closing:
                return
            rt.set_state(state)
            try:
                await self._make_room(rt, deadline)
                if rt.engine is not None and rt.engine.alive():
                    await self._engine_call(rt, _SLEEP_API[rt.config.engine][1])
                else:
                    await self._cold_start(rt)
            except ModelUnavailable as exc:  # no room in time: it stays asleep, nothing failed
                self._sync_budget()
                rt.set_state(State.ASLEEP, str(exc))
                return
            except (EngineStartError, httpx.HTTPError) as exc:
                await self._failed(rt, f"{type(exc).__name__}: {exc}".splitlines()[0])
                return
            took = time.monotonic() - t0
            if state is State.WAKING:
                rt.wakes += 1
                rt.wake_seconds.append(took)
                self.metrics.wake_seconds.labels(rt.name, rt.sleep_mode).observe(took)
            rt.failures = 0
            rt.touch()
            rt.set_state(State.AWAKE)
            self._sync_budget()
            logger.info("model %s is awake (%s in %.1f s)", rt.name, state.value, took)

    async def _cold_start(self, rt: ModelRuntime) -> None:
        async with self._start_lock:
            if rt.engine is not None:
                rt.engine.kill()
            env = engine_env(rt.config, self.registry.directory)
            rt.engine = EngineProcess.spawn(rt.config, rt.sleep_mode, env, self.log_dir)
            try:
                await rt.engine.wait_healthy(self.client, self.config.server.start_timeout_s)
            except BaseException:
                rt.engine.kill()
                await asyncio.to_thread(self.registry.reclaim)
                raise

    async def _engine_call(self, rt: ModelRuntime, path: str) -> None:
        assert rt.engine is not None
        body: dict[str, Any] | None = {} if rt.config.engine == "sglang" else None
        reply = await self.client.post(f"{rt.engine.url}{path}", json=body, timeout=300.0)
        reply.raise_for_status()

    async def _make_room(self, rt: ModelRuntime, deadline: float | None) -> None:
        """Put idle models to sleep until ``rt``'s weights and idle KV fit the budget; wait for models to
        become idle while none can go; ``ModelUnavailable`` at the deadline."""
        need = rt.weights_bytes + rt.idle_kv_bytes
        async with self._memory_lock:
            while True:
                used = self.used_bytes(exclude=rt)
                candidates = [
                    policy.Candidate(
                        o.name, o.config.priority, o.last_used, o.footprint_bytes, o.config.pinned, o.busy
                    )
                    for o in self.models.values()
                    if o is not rt and o.state is State.AWAKE
                ]
                victims = policy.choose_victims(
                    candidates, need_bytes=need, used_bytes=used, budget_bytes=self.budget_bytes,
                    for_priority=rt.config.priority,
                )  # fmt: skip
                if victims is not None:
                    for victim in victims:
                        logger.info("model %s sleeps to make room for %s", victim.name, rt.name)
                        await self._sleep(self.models[victim.name], reason=f"room for {rt.name}")
                    if not victims or policy.fits(need, self.used_bytes(exclude=rt), self.budget_bytes):
                        break
                if deadline is not None and time.monotonic() >= deadline:
                    raise ModelUnavailable(
                        f"no memory for model {rt.name}: every model holding it is busy or pinned"
                    )
                await asyncio.sleep(self.poll_s)
                await self._refresh_kv()
            # The newcomer's weights leave the budget before it loads, so neighbours' KV cannot take them.
            rt.has_room = True
            self._sync_budget()

    async def _sleep(self, rt: ModelRuntime, reason: str) -> None:
        """Put an awake, idle model to sleep (its engine's API, or stop its process)."""
        if rt.state is not State.AWAKE or rt.busy:
            return
        rt.idle_kv_bytes = rt.kv_bytes
        rt.set_state(State.SLEEPING)
        t0 = time.monotonic()
        try:
            if rt.sleep_mode == "engine" and rt.engine is not None:
                await self._engine_call(rt, _SLEEP_API[rt.config.engine][0])
            elif rt.engine is not None:
                await rt.engine.stop()
                rt.engine = None
                await asyncio.to_thread(self.registry.reclaim)
        except httpx.HTTPError as exc:
            logger.warning("model %s did not sleep (%s): stopping its engine", rt.name, exc)
            if rt.engine is not None:
                await rt.engine.stop()
                rt.engine = None
        rt.sleeps += 1
        rt.set_state(State.ASLEEP)
        await self._refresh_kv()
        self._sync_budget()
        logger.info(
            "model %s is asleep (%s, %s, %.1f s)", rt.name, reason, rt.sleep_mode, time.monotonic() - t0
        )

    async def _failed(self, rt: ModelRuntime, error: str) -> None:
        """Mark ``rt`` failed, clean its engine up, restart it with back-off (up to ``max_restarts``)."""
        srv = self.config.server
        if rt.engine is not None:
            log = rt.engine.log_path
            rt.engine.kill()
            rt.engine = None
            error = f"{error} (log {log})"
        await asyncio.to_thread(self.registry.reclaim)
        rt.failures += 1
        logger.error("model %s failed: %s", rt.name, error)
        if rt.failures > srv.max_restarts or self.closing:
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
                for rt in self.models.values():
                    if rt.state is State.AWAKE and rt.engine is not None and not rt.engine.alive():
                        await self._failed(rt, f"engine exited with {rt.engine.proc.returncode}")
                    elif rt.state is State.AWAKE and rt.engine is not None and tick % health_every == 0:
                        self._spawn(self._check_health(rt), f"health-{rt.name}")
                now = time.monotonic()
                awake = [
                    policy.Candidate(
                        r.name,
                        r.config.priority,
                        r.last_used,
                        r.footprint_bytes,
                        r.config.pinned,
                        r.busy,
                        r.idle_sleep_s,
                    )
                    for r in self.models.values()
                    if r.state is State.AWAKE
                ]
                for due in policy.due_to_sleep(awake, now):
                    rt = self.models[due.name]
                    if not rt.lock.locked():
                        self._spawn(self._idle_sleep(rt), f"sleep-{rt.name}")
                self._sync_budget()
            except Exception:
                logger.exception("monitor step failed")
            await asyncio.sleep(self.poll_s)

    async def _idle_sleep(self, rt: ModelRuntime) -> None:
        async with rt.lock:
            await self._sleep(rt, reason=f"idle {rt.idle_sleep_s:g} s")

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
            rt.kv_bytes = sum(charged[n][0] for n in names if n in charged)
            self.devices.update(charged[n][1] for n in names if n in charged)
            if rt.state is State.AWAKE and not rt.busy:
                rt.idle_kv_bytes = rt.kv_bytes

    def _sync_budget(self) -> None:
        """Keep each device's KV budget at *budget - weights of the models that have room for them*."""
        if self.budget_bytes is None:
            return
        weights = sum(rt.weights_bytes for rt in self.models.values() if rt.has_room)
        self._budget.apply(self.devices, self.budget_bytes - weights)

    # ------------------------------------------------------------------ visibility

    def status(self) -> dict[str, Any]:
        """The ``/status`` document: the server's budget and every model's entry."""
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes(),
            "devices": sorted(self.devices),
            "registry_dir": str(self.registry.directory),
            "log_dir": str(self.log_dir),
            "closing": self.closing,
            "models": [rt.status() for rt in self.models.values()],
        }
