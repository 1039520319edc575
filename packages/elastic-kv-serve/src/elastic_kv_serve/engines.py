"""Engine child processes: their command lines, environment, sleep mode, start, health and stop.

Each model runs in one engine process (vLLM's OpenAI API server module or ``sglang.launch_server``) on a
private loopback port, with ``--kv-cache-backend=elastic``, its own pool name (``ELASTIC_KV_POOL_NAME``) and
the server's registry directory (``ELASTIC_KV_REGISTRY_DIR``), so ``kvctl`` and the budget see every pool.
The process leads its own process group (a terminal's Ctrl-C reaches the server, which drains first) and
gets SIGTERM if the server dies (``PR_SET_PDEATHSIG``); stopping it signals the whole group, so the
engine's own children (vLLM's engine core, SGLang's scheduler) go with it.

Sleep modes, decided per engine at start-up from a probe of the platform in the engine's environment:

* ``engine`` -- the engine's own API: vLLM ``POST /sleep?level=1`` / ``POST /wake_up`` (needs
  ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``, available where
  ``current_platform.is_sleep_mode_available()``: CUDA, ROCm, XPU); SGLang
  ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` (needs ``--enable-memory-saver``,
  i.e. CUDA and ``torch_memory_saver``).
* ``stop`` -- where the platform cannot sleep (vLLM and SGLang on the CPU): the process is stopped and
  started again on demand (a cold start).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import httpx

from elastic_kv_serve.config import ModelConfig

__all__ = ["EngineProcess", "EngineStartError", "SleepMode", "engine_argv", "engine_env", "probe_sleep_mode"]

logger = logging.getLogger(__name__)

SleepMode = Literal["engine", "stop"]

_PR_SET_PDEATHSIG = 1

# One line of Python per engine that prints 1 when its platform can sleep through the engine's API.
_PROBES = {
    "vllm": "from vllm.platforms import current_platform as p; print(int(p.is_sleep_mode_available()))",
    "sglang": (
        "import importlib.util, torch; "
        "print(int(torch.cuda.is_available() and importlib.util.find_spec('torch_memory_saver') is not None))"
    ),
}


class EngineStartError(RuntimeError):
    """An engine exited or did not answer ``/health`` in time while starting; the message has its log tail."""


def free_port() -> int:
    """A free TCP port on the loopback interface (the engine binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(
    model: ModelConfig, registry_dir: Path, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The engine's environment: ``base`` (default ``os.environ``), the model's ``env``, its pool name and the
    server's registry directory (these two always win: the server finds the pool by them)."""
    env = dict(os.environ if base is None else base)
    env.update(model.env)
    env["ELASTIC_KV_POOL_NAME"] = model.pool_name
    env["ELASTIC_KV_REGISTRY_DIR"] = str(registry_dir)
    return env


def engine_argv(model: ModelConfig, port: int, sleep_mode: SleepMode) -> list[str]:
    """The engine's command line: the server module, the model, the loopback port, the elastic backend,
    the sleep switch where the engine sleeps through its API, then the model's ``args``."""
    if model.engine == "vllm":
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model.model, "--served-model-name", model.name,
            "--host", "127.0.0.1", "--port", str(port), "--kv-cache-backend", "elastic",
        ]  # fmt: skip
        if sleep_mode == "engine":
            argv.append("--enable-sleep-mode")
    else:
        argv = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model.model, "--served-model-name", model.name,
            "--host", "127.0.0.1", "--port", str(port), "--kv-cache-backend=elastic",
        ]  # fmt: skip
        if sleep_mode == "engine":
            argv.append("--enable-memory-saver")
    return argv + list(model.args)


def probe_sleep_mode(model: ModelConfig, env: Mapping[str, str], timeout_s: float = 120.0) -> SleepMode:
    """``engine`` when the model's engine can sleep through its API on this platform, else ``stop``.

    Runs the engine's own platform check (see ``_PROBES``) in a child with the engine's environment, so
    the answer is the platform's, not a guess from this process. SGLang with ``--device cpu`` is ``stop``.
    A probe that fails (engine not installed) raises ``EngineStartError``.
    """
    if model.engine == "sglang" and "cpu" in flag_values(model.args, "--device"):
        return "stop"
    done = subprocess.run(
        [sys.executable, "-c", _PROBES[model.engine]],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or lines[-1] not in ("0", "1"):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EngineStartError(f"model {model.name}: cannot load engine {model.engine}: {tail[0]}")
    return "engine" if lines[-1] == "1" else "stop"


def flag_values(args: list[str], flag: str) -> list[str]:
    """The values given to ``flag`` in ``args`` (``--flag V`` and ``--flag=V``)."""
    out = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith(flag + "="):
            out.append(arg.split("=", 1)[1])
    return out


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class EngineProcess:
    """One running engine: its process, port and log. Built by :meth:`spawn`."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    started_at: float
    _log: IO[bytes]

    @classmethod
    def spawn(
        cls, model: ModelConfig, sleep_mode: SleepMode, env: Mapping[str, str], log_dir: Path
    ) -> EngineProcess:
        """Start the engine of ``model`` on a free loopback port; its output goes to ``<log_dir>/<name>.log``
        (appended: restarts add to the same log)."""
        port = free_port()
        argv = engine_argv(model, port, sleep_mode)
        log_path = log_dir / f"{model.pool_name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 -- closed in _close_log once the process is gone
        log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        env = dict(env)
        if sleep_mode == "engine" and model.engine == "vllm":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # the /sleep and /wake_up routes
        logger.info("starting %s (%s) on port %d", model.name, model.engine, port)
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=_die_with_parent,  # prctl only
        )
        return cls(model.name, proc, port, log_path, time.monotonic(), log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_healthy(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Return once ``GET /health`` answers 200; ``EngineStartError`` if the process exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineStartError(
                    f"engine of {self.name} exited with {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if await self.healthy(client):
                return
            await asyncio.sleep(0.5)
        raise EngineStartError(
            f"engine of {self.name} did not become healthy in {timeout_s:.0f} s; log {self.log_path}"
        )

    async def healthy(self, client: httpx.AsyncClient, timeout_s: float = 5.0) -> bool:
        try:
            reply = await client.get(f"{self.url}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    async def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the engine (which shuts its own children down and closes its pools), then SIGKILL what is
        left of its process group, after ``timeout_s`` at most; the exit status."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL whatever is left of the process group and reap the engine (idempotent)."""
        self._signal_group(signal.SIGKILL)
        if self.proc.returncode is None:
            self.proc.wait()
        self._log.close()
