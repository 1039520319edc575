"""The three set-ups the trace is replayed against, each started once and stopped after every load.

* ``static``: native vLLM engines (no plugin loaded: ``VLLM_PLUGINS=""``), each with a fixed share. On the
  CPU the share is ``--kv-cache-memory-bytes`` = the stated KV total / N; on CUDA it is
  ``--gpu-memory-utilization`` = (what the models may use) / N, and vLLM sizes the KV cache inside it.
  As many engines as fit: when a share cannot hold a model (weights + overhead + one full-length request),
  only the first k models get engines, at 1/k each; requests for the others fail as "not served".
* ``elastic``: the same engines with ``--kv-cache-backend=elastic``, all awake. Each reserves the whole KV
  total as virtual capacity; one device budget (``Registry.set_budget``, what ``kvctl budget`` sets) of
  that total caps what they back together, so a busy model grows into its idle neighbours' memory.
* ``sleep``: ``elastic-kv serve --config`` over the same models with a budget that holds fewer models awake
  than there are (weights + KV): idle models sleep, a request for a sleeping one wakes it, putting the least
  recently used idle models to sleep to make room (every model has the same priority). On CUDA the models
  sleep through vLLM's API at level 1 (weights into the server's host arena of ``host_budget``) or level 2
  (dropped and reloaded) when the arena is full; engines start ``start_parallel`` at a time, all of them
  at start-up with ``preload``.

Engines start ``start_parallel`` at a time, except static ones on CUDA: vLLM sizes their KV cache from
the device's free memory, so they start one after another.

KV per model over time: the pools' backed bytes in the set-up's own registry directory (elastic set-ups),
the engines' fixed KV cache size (static).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from elastic_kv.sizes import format_bytes

from benchmarks.multimodel.engines import ModelShape, ServerProcess, free_port, start_all, vllm_server_argv
from benchmarks.multimodel.memory import RegistrySampler

__all__ = ["ElasticSetup", "Plan", "SleepSetup", "StaticSetup", "serve_available"]

logger = logging.getLogger("multi_model")

# The host backend's pages on the CPU: one vLLM CPU block (128 tokens) of one layer of the tiny model is
# 64 KiB, so 64 KiB pages let memory follow a small batch block by block (GPUs keep the 2 MiB default).
CPU_POOL_ENV = {"ELASTIC_KV_PAGE_SIZE": "64K", "ELASTIC_KV_RESERVE_MIN": "1", "ELASTIC_KV_RESERVE_MAX": "4"}


@dataclass
class Plan:
    """Facts every set-up shares: the device, the model, the names, the engine arguments, the sizes."""

    device: str  # "cpu" or "cuda"
    model_dir: Path
    shape: ModelShape
    names: list[str]
    engine_args: list[str]  # dtype, max-model-len, eager, dummy weights, --engine-arg ...
    max_model_len: int
    kv_total: (
        int | None
    )  # the KV memory the models share (CPU: stated; CUDA: measured by static or estimated)
    gpu_total: int  # CUDA: the device's memory; CPU: 0
    gpu_share: float  # CUDA: the part of the device the models may use
    overhead: int  # per engine, beside weights and KV (CUDA context, activations)
    awake: int  # sleep set-up on the CPU: models that fit awake at once
    idle_sleep_s: float
    start_parallel: int
    start_timeout_s: float
    logs: Path
    host_budget: str | None = None  # sleep set-up: [server] host_budget (None: the server's default)
    serve_options: dict[str, Any] = field(default_factory=dict)  # sleep set-up: more [server] settings
    host_arena_dir: Path | None = None  # sleep set-up: where the arena lives (None: the registry's dir)
    preload: bool = False  # sleep set-up: start every model at start-up
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def footprint(self) -> int:
        """The least one engine needs: weights, overhead and one full-length request's KV."""
        return self.shape.weights_bytes + self.overhead + self.max_model_len * self.shape.kv_bytes_per_token

    def base_env(self) -> dict[str, str]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes on the CPU
        env.update(self.extra_env)
        return env


def serve_available() -> bool:
    """True when the ``elastic_kv_serve`` package (``elastic-kv serve``) is importable here."""
    return importlib.util.find_spec("elastic_kv_serve") is not None


def _kv_capacity(url: str, shape: ModelShape) -> int:
    """A native engine's KV cache in bytes, from its ``vllm:cache_config_info`` metric."""
    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"]) * shape.kv_bytes_per_token
    raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info")


class _Engines:
    """What the two engine set-ups share: start, endpoints, stop."""

    name = ""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.servers: list[ServerProcess] = []
        self.failed: dict[str, str] = {}
        self.describe = ""

    def _start(self, envs: dict[str, dict[str, str]], args: list[str]) -> None:
        """Start one engine per model of ``envs`` (model name -> its environment) with ``args``."""
        items = []
        for name, env in envs.items():
            port = free_port()
            argv = vllm_server_argv(self.plan.model_dir, name, port, [*self.plan.engine_args, *args])
            items.append((name, argv, env, port, self.plan.logs / f"{self.name}-{name}.log"))
        parallel = 1 if self.name == "static" and self.plan.device == "cuda" else self.plan.start_parallel
        self.servers, self.failed = start_all(items, parallel, self.plan.start_timeout_s)
        for name, reason in self.failed.items():
            logger.warning("%s: %s has no engine: %s", self.name, name, reason.splitlines()[0])

    @property
    def endpoints(self) -> dict[str, str]:
        return {s.name: s.url for s in self.servers}

    def info(self) -> dict[str, Any]:
        return {
            "describe": self.describe,
            "engines": {
                s.name: {"ready_s": round(s.ready_s or 0.0, 1), "pid": s.proc.pid} for s in self.servers
            },
            "not_started": self.failed,
        }

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []


class StaticSetup(_Engines):
    """Native engines with fixed shares (see the module docstring)."""

    name = "static"

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self.kv_bytes: dict[str, int] = {}

    def shares(self) -> tuple[int, list[str]]:
        """How many engines fit and the arguments that give each its share (sets ``describe``)."""
        plan = self.plan
        n = len(plan.names)
        if plan.device == "cpu":
            assert plan.kv_total is not None
            fit = min(n, max(1, plan.kv_total // (plan.max_model_len * plan.shape.kv_bytes_per_token)))
            share = plan.kv_total // fit
            args = ["--kv-cache-memory-bytes", str(share)]
            self.describe = f"{fit} native engine(s), --kv-cache-memory-bytes {share} each (KV total / {fit})"
        else:
            usable = plan.gpu_share * plan.gpu_total
            fit = min(n, max(1, int(usable // plan.footprint)))
            util = plan.gpu_share / fit
            args = ["--gpu-memory-utilization", f"{util:.4f}"]
            self.describe = (
                f"{fit} native engine(s), --gpu-memory-utilization {util:.4f} each "
                f"({plan.gpu_share:g} / {fit})"
            )
        if fit < n:
            self.describe += f"; {n - fit} model(s) do not fit"
        return fit, args

    def start(self) -> None:
        plan = self.plan
        fit, args = self.shares()
        env = {**plan.base_env(), "VLLM_PLUGINS": ""}
        self._start({name: env for name in plan.names[:fit]}, args)
        self.kv_bytes = {s.name: _kv_capacity(s.url, plan.shape) for s in self.servers}
        logger.info("static: KV per engine %s", {k: f"{v / 2**20:.1f} MiB" for k, v in self.kv_bytes.items()})

    def info(self) -> dict[str, Any]:
        return {**super().info(), "kv_bytes": self.kv_bytes, "kv_total_bytes": sum(self.kv_bytes.values())}


class ElasticSetup(_Engines):
    """The same engines with the elastic KV cache, all awake, one device budget (see the module docstring)."""

    name = "elastic"

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self.registry = Path(tempfile.mkdtemp(prefix="mm-elastic-registry-"))
        self.pools = {f"bench.{name}": name for name in plan.names}

    def start(self) -> None:
        from elastic_kv.registry import Registry

        plan = self.plan
        assert plan.kv_total is not None
        n = len(plan.names)
        args = ["--kv-cache-backend", "elastic", "--kv-cache-memory-bytes", str(plan.kv_total)]
        if plan.device == "cuda":
            args += ["--gpu-memory-utilization", f"{plan.gpu_share / n:.4f}"]
        env = {**plan.base_env(), "ELASTIC_KV_REGISTRY_DIR": str(self.registry)}
        if plan.device == "cpu":
            env.update(CPU_POOL_ENV)
        self._start({name: {**env, "ELASTIC_KV_POOL_NAME": pool} for pool, name in self.pools.items()}, args)
        registry = Registry(self.registry)
        devices = sorted({p.device for p in registry.pools() if p.name in self.pools})
        for device in devices:
            registry.set_budget(device, plan.kv_total)
        self.describe = (
            f"{len(self.servers)} engine(s) with --kv-cache-backend=elastic, each --kv-cache-memory-bytes "
            f"{plan.kv_total} (virtual), one device budget of {format_bytes(plan.kv_total)} on "
            f"{', '.join(devices) or '?'}"
        )

    def sampler(self, period_s: float) -> RegistrySampler:
        return RegistrySampler(self.registry, self.pools, period_s)

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.registry, ignore_errors=True)


class SleepSetup:
    """``elastic-kv serve --config`` over every model, with sleep and wake (see the module docstring)."""

    name = "sleep"

    def __init__(self, plan: Plan, config_path: Path) -> None:
        self.plan = plan
        self.config_path = config_path
        self.registry = Path(tempfile.mkdtemp(prefix="mm-sleep-registry-"))
        self.server: ServerProcess | None = None
        self.describe = ""
        self.weights_bytes = 0
        self.budget_bytes = 0
        from elastic_kv_serve.config import pool_name_for

        self.pools = {pool_name_for(name): name for name in plan.names}

    def config(self, port: int) -> tuple[str, int]:
        """The TOML config of this set-up and its budget in bytes.

        CUDA: the budget is ``gpu_share`` of the device; each model's weights are its parameters plus the
        per-engine overhead, and its virtual KV capacity is what the budget leaves beside one model's
        weights. CPU: a tiny model's real weights (a few MiB) would never make models compete, so each model
        declares its weights plus the KV total as ``weights_bytes`` and the budget is ``awake`` such
        footprints plus the KV total: at most ``awake`` models fit awake at once, and with that many awake
        the KV they share is the KV total, as in the other set-ups.
        """
        from elastic_kv_serve.config import render_config  # the sleep set-up needs elastic_kv_serve

        plan = self.plan
        if plan.device == "cpu":
            assert plan.kv_total is not None
            weights = plan.shape.weights_bytes + plan.overhead + plan.kv_total
            budget = plan.awake * weights + plan.kv_total
            args = ["--kv-cache-memory-bytes", str(plan.kv_total)]
            env = CPU_POOL_ENV
        else:
            weights = plan.shape.weights_bytes + plan.overhead
            budget = int(plan.gpu_share * plan.gpu_total)
            util = min(plan.gpu_share, (weights + 2**30) / plan.gpu_total)
            args = [
                "--kv-cache-memory-bytes",
                str(budget - weights),
                "--gpu-memory-utilization",
                f"{util:.4f}",
            ]
            env = {}
        server: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": port,
            "registry_dir": str(self.registry),
            "budget": budget,
            "idle_sleep_s": plan.idle_sleep_s,
            "start_timeout_s": plan.start_timeout_s,
            "wake_timeout_s": plan.start_timeout_s,
            "start_parallel": plan.start_parallel,
            "preload": plan.preload,
            "max_queued": 4096,
            "log_dir": str(plan.logs / "sleep-engines"),
        }
        if plan.host_budget is not None:
            server["host_budget"] = plan.host_budget
        if plan.host_arena_dir is not None:
            server["host_arena_dir"] = str(plan.host_arena_dir)
        server.update(plan.serve_options)
        models: list[dict[str, Any]] = []
        for name in plan.names:
            model: dict[str, Any] = {
                "name": name,
                "engine": "vllm",
                "model": str(plan.model_dir),
                "args": [*plan.engine_args, *args],
                "idle_sleep_s": plan.idle_sleep_s,
                "weights_bytes": weights,
            }
            if env:
                model["env"] = dict(env)
            models.append(model)
        self.weights_bytes, self.budget_bytes = weights, budget
        return render_config(server, models), budget

    def start(self) -> None:
        plan = self.plan
        port = free_port()
        text, budget = self.config(port)
        self.config_path.write_text(text)
        (plan.logs / "sleep-engines").mkdir(parents=True, exist_ok=True)
        awake = min(len(plan.names), budget // self.weights_bytes)
        self.describe = (
            f"elastic-kv serve --config {self.config_path.name}: {len(plan.names)} models, budget "
            f"{format_bytes(budget)} for weights ({format_bytes(self.weights_bytes)} a model) + KV, "
            f"at most {awake} awake, idle_sleep_s {plan.idle_sleep_s:g}, start_parallel {plan.start_parallel}"
            + (", preload" if plan.preload else "")
            + (f", host_budget {plan.host_budget}" if plan.host_budget is not None else "")
            + "".join(f", {k} {v}" for k, v in plan.serve_options.items())
        )
        argv = [sys.executable, "-m", "elastic_kv_serve", "serve", "--config", str(self.config_path)]
        self.server = ServerProcess(
            "elastic-kv serve", argv, plan.base_env(), port, plan.logs / "sleep-serve.log"
        )
        timeout = plan.start_timeout_s * len(plan.names)
        self.server.wait_ready(timeout)
        self._wait_started(timeout)

    def status(self) -> dict[str, Any]:
        """The server's ``/status`` document."""
        assert self.server is not None
        doc: dict[str, Any] = httpx.get(f"{self.server.url}/status", timeout=10.0, trust_env=False).json()
        return doc

    def awake_models(self) -> list[str]:
        """The models awake now (after start-up: those whose weights fit the budget)."""
        return [m["name"] for m in self.status()["models"] if m["state"] == "awake"]

    def _wait_started(self, timeout_s: float) -> None:
        """Wait until no model is starting; ``RuntimeError`` naming a model that failed to start."""
        assert self.server is not None
        deadline = time.monotonic() + timeout_s
        while True:
            states = {m["name"]: m["state"] for m in self.status()["models"]}
            bad = {n: s for n, s in states.items() if s in ("failed", "stopped")}
            if bad:
                raise RuntimeError(
                    f"elastic-kv serve: models did not start: {bad}; see {self.server.log_path}"
                )
            if "starting" not in states.values():
                logger.info("sleep: model states after start-up: %s", states)
                return
            if time.monotonic() > deadline or not self.server.alive():
                raise RuntimeError(
                    f"elastic-kv serve: models still starting: {states}; see {self.server.log_path}"
                )
            time.sleep(1.0)

    @property
    def endpoints(self) -> dict[str, str]:
        assert self.server is not None
        return dict.fromkeys(self.plan.names, self.server.url)

    def sampler(self, period_s: float) -> RegistrySampler:
        def states() -> tuple[dict[str, str], int]:
            doc = self.status()
            return {m["name"]: m["state"] for m in doc["models"]}, int(doc.get("host_used_bytes") or 0)

        return RegistrySampler(self.registry, self.pools, period_s, states)

    def info(self) -> dict[str, Any]:
        ready = None if self.server is None else round(self.server.ready_s or 0.0, 1)
        info: dict[str, Any] = {
            "describe": self.describe,
            "config": self.config_path.name,
            "ready_s": ready,
            # what report.memory_demand weighs the trace with: the server's budget (weights and KV)
            "budget_bytes": self.budget_bytes,
            "model_bytes": self.weights_bytes,
            "kv_bytes_per_token": self.plan.shape.kv_bytes_per_token,
        }
        if self.server is not None and self.server.alive():
            try:
                info["final_status"] = self.status()  # wakes, wake p50/p99, sleep mode per model
            except (httpx.HTTPError, ValueError) as exc:
                logger.warning("sleep: no final /status: %s", exc)
        return info

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(timeout_s=120)
            self.server = None
        shutil.rmtree(self.registry, ignore_errors=True)
