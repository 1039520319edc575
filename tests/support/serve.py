"""``elastic-kv serve`` in a child process, for the server's tests and the demo.

:class:`ServeProcess` writes a TOML config, starts ``python -m elastic_kv_serve serve --config ...`` as a
:class:`elastic_kv_serve.process.ChildProcess` (its output in a log file), reads ``/status``, waits for
model states, and stops the server with SIGTERM (the drain path) or, if that fails, SIGKILL.
"""

from __future__ import annotations

import os
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from elastic_kv_serve.config import render_config
from elastic_kv_serve.engines import free_port
from elastic_kv_serve.process import ChildProcess

from tests.support import engine_logs
from tests.support.models import REPO_ROOT

# vLLM on the CPU for a tiny model: float32, eager, a fixed (virtual) KV capacity.
VLLM_CPU_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
                 "--kv-cache-memory-bytes", "32M", "--seed", "0"]  # fmt: skip
# SGLang's CPU engine for a tiny model (see tests/support/sglang_engine.py).
# --sleep-on-idle: an idle SGLang scheduler otherwise polls in a busy loop, a core at 100 %.
SGLANG_CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                   "--dtype", "float32", "--max-total-tokens", "16384", "--page-size", "16",
                   "--random-seed", "0", "--log-level", "warning", "--sleep-on-idle"]  # fmt: skip
# 64 KiB pages: one block of a tiny model per page and layer, so KV memory follows a few requests.
POOL_ENV = {"ELASTIC_KV_PAGE_SIZE": "64K", "ELASTIC_KV_RESERVE_MIN": "1", "ELASTIC_KV_RESERVE_MAX": "4"}


def sglang_cpu_env() -> dict[str, str]:
    """What SGLang's CPU engine needs in its environment: its switches and the sgl_kernel stand-in."""
    from tests.support.sglang_engine import engine_environ

    env = engine_environ({}, base={})
    keep = ("SGLANG_USE_CPU_ENGINE", "SGLANG_NATIVE_MOVE_KV_CACHE", "OMP_NUM_THREADS", "PYTHONPATH")
    return {**{k: env[k] for k in keep}, **POOL_ENV}


def write_config(path: Path, server: dict[str, Any], models: list[dict[str, Any]]) -> Path:
    path.write_text(render_config(server, models))
    return path


class ServeProcess:
    """A running ``elastic-kv serve`` (see the module docstring)."""

    def __init__(
        self,
        workdir: Path,
        server: dict[str, Any],
        models: list[dict[str, Any]],
        *,
        headers: dict[str, str] | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """``headers`` (an API key) and ``verify`` (a CA file, for a server with ``ssl_certfile``) go with
        every request this object sends."""
        self.workdir = workdir
        self.registry = workdir / "registry"
        self.registry.mkdir(mode=0o700, exist_ok=True)
        self.port = free_port()
        scheme = "https" if "ssl_certfile" in server else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        server = {
            "port": self.port,
            "registry_dir": str(self.registry),
            "log_dir": str(workdir / "logs"),
            # The default (40 % of host memory, prefaulted next to the registry) would put gigabytes on the
            # temporary directory's file system for every server; the tiny models' weights need a few MiB.
            "host_budget": "256M",
            **server,
        }
        self.config = write_config(workdir / "models.toml", server, models)
        self.log_path = workdir / "serve.log"
        engine_logs.watch(self.log_path, f"{workdir.name}/serve.log")
        engine_logs.watch(workdir / "logs", f"{workdir.name}/logs")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        argv = [sys.executable, "-m", "elastic_kv_serve", "serve", "--config", str(self.config)]
        self.child = ChildProcess(argv, env, self.log_path, cwd=REPO_ROOT)
        self.proc = self.child.proc
        self.client = httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(600.0, connect=5.0), headers=headers, verify=verify
        )

    def log_tail(self, lines: int = 40) -> str:
        return engine_logs.tail(self.log_path, lines)

    def document(self) -> dict[str, Any]:
        """The server's whole ``/status`` document."""
        reply = self.client.get("/status", timeout=10)
        reply.raise_for_status()
        doc: dict[str, Any] = reply.json()
        return doc

    def status(self) -> dict[str, Any]:
        """Each model's ``/status`` entry, by name."""
        return {m["name"]: m for m in self.document()["models"]}

    def wait_for(self, states: dict[str, str], timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait until every named model is in its state; the status then. TimeoutError with the log tail."""
        last: dict[str, Any] = {}

        def reached() -> dict[str, Any] | None:
            nonlocal last
            last = self.status()
            return last if all(last[name]["state"] == state for name, state in states.items()) else None

        def failure() -> str:
            seen = {n: m["state"] for n, m in last.items()}
            return f"models not {states} after {timeout_s:.0f} s (now {seen})"

        return self._poll(reached, timeout_s, failure)

    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait until the server's start-up is done (``/ready``); the status then. TimeoutError with the log
        tail."""

        def ready() -> dict[str, Any] | None:
            return self.status() if httpx.get(f"{self.url}/ready", timeout=10).status_code == 200 else None

        return self._poll(ready, timeout_s, lambda: f"the server was not ready after {timeout_s:.0f} s")

    def _poll(
        self, probe: Callable[[], dict[str, Any] | None], timeout_s: float, failure: Callable[[], str]
    ) -> dict[str, Any]:
        """``probe()`` every 0.25 s (0.5 s after an HTTP error: the server is not up yet) until it returns a
        status; RuntimeError when the server exits, TimeoutError with ``failure()`` and the log tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                found = probe()
            except httpx.HTTPError:
                time.sleep(0.5)
                continue
            if found is not None:
                return found
            time.sleep(0.25)
        raise TimeoutError(f"{failure()}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 180.0) -> int:
        """SIGTERM (drain), SIGKILL after ``timeout_s``; the exit status. After a drain the server exits by
        the signal it got (uvicorn re-raises it once shut down): ``-SIGTERM`` is the clean answer."""
        code = self.child.stop(timeout_s)
        self.client.close()
        engine_logs.unwatch(self.log_path)
        engine_logs.unwatch(self.workdir / "logs")
        return code
