"""Engine child processes: their command lines, environment, sleep mode, start, health and stop.

Each model runs in one engine process (vLLM's OpenAI API server module or ``sglang.launch_server``) on a
private loopback port, with ``--kv-cache-backend=elastic``, its own pool name (``ELASTIC_KV_POOL_NAME``) and
the server's registry directory (``ELASTIC_KV_REGISTRY_DIR``), so ``kvctl`` and the budget see every pool.
The process leads its own process group (a terminal's Ctrl-C reaches the server, which drains first) and
gets SIGTERM if the server dies; stopping it ends its whole group, so the engine's own children (vLLM's
engine core, SGLang's scheduler) go with it (:class:`elastic_kv_serve.process.ChildProcess`).

How each engine is started, probed, put to sleep and woken: :mod:`elastic_kv_serve.kinds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import TypeVar

import httpx
from elastic_kv.host import ENV_HOST_ARENA

from elastic_kv_serve.config import ModelConfig
from elastic_kv_serve.kinds import SleepMode, kind_of
from elastic_kv_serve.process import ChildProcess

__all__ = ["EngineDied", "EngineProcess", "EngineStartError", "cause_in_log", "engine_env", "free_port"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineStartError(RuntimeError):
    """An engine exited or did not answer ``/health`` in time while starting. ``cause``: the line of its log
    that says why (:func:`cause_in_log`), if it exited."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class EngineDied(httpx.TransportError):
    """An engine died while the server waited for it to sleep or wake: its process exited, or its server
    refuses connections or answers ``/health`` with an error (vLLM's API server outlives a dead engine core
    while clients keep connections open, and a sleep or wake sent to it then never answers). An
    ``httpx.TransportError``, so that it is handled as any failed call to the engine."""


# Seconds between two looks at an engine's health while a sleep or wake waits for it, and how many failed
# looks in a row mean it died (a slow answer never counts: a wake that reloads weights keeps a server busy).
WATCH_S = 5.0
WATCH_FAILURES = 2


# A line that names what went wrong: "ValueError: ...", "torch.OutOfMemoryError: ...", "... ERROR ... msg".
_CAUSE = re.compile(r"(?:^|[\s\]])(?:\w+\.)*(\w+(?:Error|Exception|Exit))(?::\s*(.*))?$")


# A wrapper's message (vLLM's front end over its engine core): the cause is an earlier line.
_POINTS_BACK = ("root cause above", "see above")


def cause_in_log(text: str, limit: int = 300) -> str:
    """The last line of an engine's log that names an exception (``SomeError: message``, with the indented
    lines that continue it, as pydantic's errors have) other than one that points back at an earlier one,
    else that one, else the log's last non-empty line; at most ``limit`` characters."""
    raw = text.splitlines()
    wrapper = None
    for i in range(len(raw) - 1, -1, -1):
        match = _CAUSE.search(raw[i].strip())
        if not match:
            continue
        parts = [f"{match.group(1)}: {match.group(2)}" if match.group(2) else match.group(1)]
        for more in raw[i + 1 :]:
            if not more[:1].isspace() or more.strip().startswith("For further information"):
                break
            parts.append(more.strip())
        found = " ".join(parts)
        if not any(p in found.lower() for p in _POINTS_BACK):
            return found[:limit]
        wrapper = wrapper or found
    last = next((line.strip() for line in reversed(raw) if line.strip()), "(empty log)")
    return (wrapper or last)[:limit]


def free_port() -> int:
    """A free TCP port on the loopback interface (the engine binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(
    model: ModelConfig,
    registry_dir: Path,
    base: Mapping[str, str] | None = None,
    host_arena: Path | None = None,
) -> dict[str, str]:
    """The engine's environment: ``base`` (default ``os.environ``), the model's ``env``, its pool name, the
    server's registry directory and host arena (these always win: the server finds the pool by them), and
    ``ELASTIC_KV_PARK_KV=1`` unless set already: the server's engines never change their weights while
    asleep, so a suspension parks its requests' KV instead of having them computed again."""
    env = dict(os.environ if base is None else base)
    env.update(model.env)
    env.setdefault("ELASTIC_KV_PARK_KV", "1")
    env["ELASTIC_KV_POOL_NAME"] = model.pool_name
    env["ELASTIC_KV_REGISTRY_DIR"] = str(registry_dir)
    if host_arena is not None:
        env[ENV_HOST_ARENA] = str(host_arena)
    else:
        env.pop(ENV_HOST_ARENA, None)
    return env


class EngineProcess(ChildProcess):
    """One running engine: its process, port and log. Built by :meth:`spawn`."""

    def __init__(
        self, name: str, argv: list[str], env: Mapping[str, str], log_path: Path, port: int, health_path: str
    ) -> None:
        super().__init__(argv, env, log_path)
        self.name = name
        self.port = port
        self.health_path = health_path

    @classmethod
    def spawn(
        cls, model: ModelConfig, sleep_mode: SleepMode, env: Mapping[str, str], log_dir: Path
    ) -> EngineProcess:
        """Start the engine of ``model`` on a free loopback port; its output goes to ``<log_dir>/<name>.log``
        (appended: restarts add to the same log)."""
        port = free_port()
        kind = kind_of(model)
        logger.info("starting %s (%s) on port %d", model.name, model.engine, port)
        return cls(
            model.name,
            kind.argv(model, port, sleep_mode),
            {**env, **kind.extra_env(sleep_mode)},
            log_dir / f"{model.pool_name}.log",
            port,
            kind.health_path(model),
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_healthy(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Return once ``GET /health`` answers 200; ``EngineStartError`` if the process exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                cause = cause_in_log(self.log_tail(200))
                raise EngineStartError(
                    f"engine of {self.name} exited with {self.proc.returncode} while starting: {cause}", cause
                )
            if await self.healthy(client):
                return
            await asyncio.sleep(0.5)
        raise EngineStartError(f"engine of {self.name} did not become healthy in {timeout_s:.0f} s")

    async def healthy(self, client: httpx.AsyncClient, timeout_s: float = 5.0) -> bool:
        try:
            reply = await client.get(f"{self.url}{self.health_path}", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def refuses(self, client: httpx.AsyncClient, timeout_s: float = WATCH_S) -> bool:
        """Whether the engine says plainly that it cannot serve: its process exited, its server refuses the
        connection, or ``/health`` answers other than 200. An answer that takes longer than ``timeout_s``
        is not counted (a busy engine, not a dead one)."""
        if not self.alive():
            return True
        try:
            reply = await client.get(f"{self.url}{self.health_path}", timeout=timeout_s)
        except httpx.TimeoutException:
            return False
        except httpx.HTTPError:
            return True
        return reply.status_code != 200

    async def while_alive(self, client: httpx.AsyncClient, call: Awaitable[T], what: str) -> T:
        """Await ``call`` (a sleep or a wake sent to this engine) while the engine lives: every
        :data:`WATCH_S` it is asked :meth:`refuses`; :data:`WATCH_FAILURES` refusals in a row cancel the
        call and raise :class:`EngineDied` (``what`` names the call in its message)."""
        task = asyncio.ensure_future(call)
        refused = 0
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_S)
                if done:
                    return task.result()
                refused = refused + 1 if await self.refuses(client) else 0
                if refused >= WATCH_FAILURES:
                    raise EngineDied(f"engine of {self.name} died while it was asked to {what}")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task
