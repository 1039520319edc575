"""What differs between engines: how each is started, probed, put to sleep and woken.

One :class:`EngineKind` per ``engine`` value of the config:

* ``vllm`` -- ``python -m vllm.entrypoints.openai.api_server``. Sleeps through its API where the platform
  allows (``current_platform.is_sleep_mode_available()``: CUDA, ROCm, XPU), started with
  ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``. Level 1: ``POST /sleep?level=1`` keeps the weights
  in host memory (the host arena, through the plugin's sleep-mode backend), ``POST /wake_up`` brings them
  back. Level 2: ``POST /sleep?level=2`` drops them; waking is vLLM's documented sequence ``/wake_up?tags=
  weights``, ``/collective_rpc`` ``reload_weights`` (from the checkpoint: not for ``--load-format dummy``,
  whose sleeps are level 1 or a stop), ``/wake_up?tags=kv_cache``. Once it serves, ``/collective_rpc``
  ``elastic_kv_pin_host`` page-locks the arena in its worker, so that no sleep pays for pinning, and says how
  much of the arena its level-1 sleep will take.
  ``/collective_rpc`` ``elastic_kv_demote`` turns a level-1 sleep into a level-2 one (where level 2 can
  reload the weights), giving its arena extent back. A
  suspension (a sleep while it serves) adds ``mode=keep``: vLLM pauses its scheduler with its requests,
  and the plugin parks their KV in host memory (``ELASTIC_KV_PARK_KV``, which the server sets; the worker's
  ``elastic_kv_info`` says how much: still charged on the pool's record, gone from the device); the wake
  maps it back and resumes the scheduler, which goes on where it was.
* ``sglang`` -- ``python -m sglang.launch_server``; sleeps where CUDA and ``torch_memory_saver`` are there
  (``--enable-memory-saver``): ``/release_memory_occupation`` and ``/resume_memory_occupation``, level 1
  only, host memory counted as its weights (SGLang keeps them itself, outside the arena).
* ``command`` -- any OpenAI-compatible server the config starts with ``command`` (``{port}`` and
  ``{model}`` substituted); it sleeps through ``sleep_path`` / ``wake_path`` (``{level}`` substituted:
  levels 1 and 2) when both are given, and its level-1 copies are expected in the arena it finds in
  ``ELASTIC_KV_HOST_ARENA``. A ``sleep_path`` with ``{mode}`` (``keep`` or ``abort``) can be suspended
  (a keep-mode sleep that parks its requests' KV in host memory answers ``{"parked_bytes": N}``);
  with a ``demote_path``, a level-1 sleep can be turned into a level-2 one.

Where an engine cannot sleep through its API, sleeping stops its process (``stop`` mode) and waking
cold-starts it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from typing import Any, Literal

import httpx

from elastic_kv_serve.config import ModelConfig

__all__ = ["KINDS", "EngineKind", "SleepMode", "flag_values", "kind_of"]

SleepMode = Literal["engine", "stop"]


def flag_values(args: list[str], flag: str) -> list[str]:
    """The values given to ``flag`` in ``args`` (``--flag V`` and ``--flag=V``)."""
    out = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith(flag + "="):
            out.append(arg.split("=", 1)[1])
    return out


async def _post(client: httpx.AsyncClient, url: str, json: Any = None) -> httpx.Response:
    reply = await client.post(url, json=json, timeout=600.0)
    reply.raise_for_status()
    return reply


class EngineKind:
    """The base: an engine that cannot sleep through its API (see the module docstring)."""

    name = ""
    levels: tuple[int, ...] = ()  # API sleep levels
    uses_arena = False  # its level-1 copies go to the host arena (else: host memory of its own)
    probe_code: str | None = None  # one line of Python printing 1 when the platform can sleep

    def argv(self, model: ModelConfig, port: int, sleep_mode: SleepMode) -> list[str]:
        """The engine's command line."""
        raise NotImplementedError

    def extra_env(self, sleep_mode: SleepMode) -> dict[str, str]:
        """Variables the engine needs for ``sleep_mode``."""
        return {}

    def probe(self, model: ModelConfig, env: Mapping[str, str], timeout_s: float = 120.0) -> SleepMode:
        """``engine`` when the model's engine can sleep through its API here, else ``stop``: the engine's own
        platform check, run in a child with the engine's environment. :class:`RuntimeError` (its last
        line) when the engine cannot even be imported."""
        if self.probe_code is None:
            return "stop"
        done = subprocess.run(
            [sys.executable, "-c", self.probe_code],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines or lines[-1] not in ("0", "1"):
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"model {model.name}: cannot load engine {self.name}: {tail[0]}")
        return "engine" if lines[-1] == "1" else "stop"

    def levels_for(self, model: ModelConfig) -> tuple[int, ...]:
        """The sleep levels ``model`` can use (``levels``, less what its arguments rule out)."""
        return self.levels

    def health_path(self, model: ModelConfig) -> str:
        return "/health"

    async def after_start(self, client: httpx.AsyncClient, url: str, arena: bool) -> int:
        """Once the engine answers its health check (before it serves). Returns the bytes of the host arena
        its level-1 sleep will take, where the engine says (0: not known until it sleeps)."""
        return 0

    def can_suspend(self, model: ModelConfig) -> bool:
        """Whether ``model``'s engine can sleep while it serves, keeping its requests for its wake."""
        return False

    def can_demote(self, model: ModelConfig) -> bool:
        """Whether ``model``'s engine, asleep at level 1 in the host arena, can turn that into level 2."""
        return False

    async def sleep(
        self, client: httpx.AsyncClient, url: str, model: ModelConfig, level: int, keep: bool = False
    ) -> int:
        """Sleep at ``level``; ``keep`` (where :meth:`can_suspend`): requests in flight resume on wake-up.
        Returns the KV bytes the engine parked in host memory for them (still charged on its pools, gone
        from the device; its wake-up maps them back), 0 where it parked none."""
        raise NotImplementedError

    async def demote(self, client: httpx.AsyncClient, url: str, model: ModelConfig) -> None:
        """Turn a level-1 sleep in the arena into a level-2 one (where :meth:`can_demote`): its extent is
        free when this returns, and the next wake is level 2's."""
        raise NotImplementedError

    async def wake(self, client: httpx.AsyncClient, url: str, model: ModelConfig, level: int) -> None:
        raise NotImplementedError


class VllmKind(EngineKind):
    name = "vllm"
    levels = (1, 2)
    uses_arena = True
    probe_code = "from vllm.platforms import current_platform as p; print(int(p.is_sleep_mode_available()))"

    def argv(self, model: ModelConfig, port: int, sleep_mode: SleepMode) -> list[str]:
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model.model, "--served-model-name", model.name,
            "--host", "127.0.0.1", "--port", str(port), "--kv-cache-backend", "elastic",
        ]  # fmt: skip
        if sleep_mode == "engine":
            argv.append("--enable-sleep-mode")
        return argv + list(model.args)

    def extra_env(self, sleep_mode: SleepMode) -> dict[str, str]:
        return {"VLLM_SERVER_DEV_MODE": "1"} if sleep_mode == "engine" else {}  # /sleep, /collective_rpc

    def levels_for(self, model: ModelConfig) -> tuple[int, ...]:
        # reload_weights reads a checkpoint: random weights (--load-format dummy) cannot be reloaded
        return (1,) if "dummy" in flag_values(model.args, "--load-format") else self.levels

    async def after_start(self, client: httpx.AsyncClient, url: str, arena: bool) -> int:
        if not arena:
            return 0
        reply = await _post(client, f"{url}/collective_rpc", {"method": "elastic_kv_pin_host"})
        # one result a worker (tensor- and pipeline-parallel ranks each sleep their own weights)
        return sum(int(r.get("level_one_bytes", 0)) for r in reply.json().get("results", []) if r)

    def can_suspend(self, model: ModelConfig) -> bool:
        return True

    def can_demote(self, model: ModelConfig) -> bool:
        return 2 in self.levels_for(model)

    async def demote(self, client: httpx.AsyncClient, url: str, model: ModelConfig) -> None:
        await _post(client, f"{url}/collective_rpc", {"method": "elastic_kv_demote"})

    async def sleep(
        self, client: httpx.AsyncClient, url: str, model: ModelConfig, level: int, keep: bool = False
    ) -> int:
        await _post(client, f"{url}/sleep?level={level}" + ("&mode=keep" if keep else ""))
        if not keep:
            return 0
        try:  # asleep either way: a worker that cannot say (an older plugin) parked nothing
            reply = await _post(client, f"{url}/collective_rpc", {"method": "elastic_kv_info"})
        except httpx.HTTPStatusError:
            return 0
        return sum(int(r.get("parked_bytes", 0)) for r in reply.json().get("results", []) if r)

    async def wake(self, client: httpx.AsyncClient, url: str, model: ModelConfig, level: int) -> None:
        if level == 1:
            await _post(client, f"{url}/wake_up")
            return
        await _post(client, f"{url}/wake_up?tags=weights")
        await _post(client, f"{url}/collective_rpc", {"method": "reload_weights"})
        await _post(client, f"{url}/wake_up?tags=kv_cache")


class SglangKind(EngineKind):
    name = "sglang"
    levels = (1,)
    probe_code = (
        "import importlib.util, torch; "
        "print(int(torch.cuda.is_available() and importlib.util.find_spec('torch_memory_saver') is not None))"
    )

    def argv(self, model: ModelConfig, port: int, sleep_mode: SleepMode) -> list[str]:
        argv = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model.model, "--served-model-name", model.name,
            "--host", "127.0.0.1", "--port", str(port), "--kv-cache-backend=elastic",
        ]  # fmt: skip
        if sleep_mode == "engine":
            argv.append("--enable-memory-saver")
        return argv + list(model.args)

    def probe(self, model: ModelConfig, env: Mapping[str, str], timeout_s: float = 120.0) -> SleepMode:
        if "cpu" in flag_values(model.args, "--device"):
            return "stop"
        return super().probe(model, env, timeout_s)

    async def sleep(
        self, client: httpx.AsyncClient, url: str, model: ModelConfig, level: int, keep: bool = False
    ) -> int:
        await _post(client, f"{url}/release_memory_occupation", {})
        return 0

    async def wake(self, client: httpx.AsyncClient, url: str, model: ModelConfig, level: int) -> None:
        await _post(client, f"{url}/resume_memory_occupation", {})


class CommandKind(EngineKind):
    name = "command"
    levels = (1, 2)
    uses_arena = True

    def argv(self, model: ModelConfig, port: int, sleep_mode: SleepMode) -> list[str]:
        assert model.command is not None  # the config's validator requires it
        fill = {"{port}": str(port), "{model}": model.model}
        out = []
        for part in [*model.command, *model.args]:
            for key, value in fill.items():
                part = part.replace(key, value)
            out.append(part)
        return out

    def probe(self, model: ModelConfig, env: Mapping[str, str], timeout_s: float = 120.0) -> SleepMode:
        return "engine" if model.sleep_path is not None else "stop"

    def health_path(self, model: ModelConfig) -> str:
        return model.health_path

    def can_suspend(self, model: ModelConfig) -> bool:
        return model.sleep_path is not None and "{mode}" in model.sleep_path

    def can_demote(self, model: ModelConfig) -> bool:
        return model.demote_path is not None

    async def demote(self, client: httpx.AsyncClient, url: str, model: ModelConfig) -> None:
        assert model.demote_path is not None
        await _post(client, url + model.demote_path)

    async def sleep(
        self, client: httpx.AsyncClient, url: str, model: ModelConfig, level: int, keep: bool = False
    ) -> int:
        assert model.sleep_path is not None
        path = model.sleep_path.replace("{level}", str(level)).replace("{mode}", "keep" if keep else "abort")
        reply = await _post(client, url + path)
        try:
            body = reply.json()
        except ValueError:
            return 0
        return int(body.get("parked_bytes", 0)) if keep and isinstance(body, dict) else 0

    async def wake(self, client: httpx.AsyncClient, url: str, model: ModelConfig, level: int) -> None:
        assert model.wake_path is not None
        await _post(client, url + model.wake_path.replace("{level}", str(level)))


KINDS: dict[str, EngineKind] = {k.name: k for k in (VllmKind(), SglangKind(), CommandKind())}


def kind_of(model: ModelConfig) -> EngineKind:
    """The :class:`EngineKind` of ``model``'s ``engine``."""
    return KINDS[model.engine]
