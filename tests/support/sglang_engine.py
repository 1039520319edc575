"""A real ``sglang.Engine`` on the CPU, in its own process, for engine tests and benchmarks.

SGLang's CPU engine needs process-wide settings (``SGLANG_USE_CPU_ENGINE=1`` before sglang is imported,
the pure-torch ``sgl_kernel`` stand-in on ``PYTHONPATH``, ``SGLANG_NATIVE_MOVE_KV_CACHE=1``). Setting them
in the pytest process would leak into every other test (in-process unit tests must see a plain SGLang
import), so each engine runs in a driver process (:mod:`tests.support.sglang_driver`) started with that
environment; the driver is the engine's main process and its schedulers inherit the environment.
The test talks to the driver over an inherited pipe: one request, one reply.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from elastic_kv.registry import Registry
from elastic_kv.snapshot import PoolSnapshot

from tests.support import engine_logs
from tests.support.models import REPO_ROOT
from tests.support.processes import stop_process

STAND_IN = REPO_ROOT / "tests" / "support" / "sgl_kernel_cpu"
LOG_DIR = REPO_ROOT / ".cache" / "logs" / "sglang"
# A batch of mixed lengths for lowered-limit tests: prompts of 8 to 120 tokens, each decoding 96 more, so the
# requests SGLang retracts first (fewest output tokens, then longest prompt) hold different numbers of pages
# and the drain's choice of pages decides how many it retracts.
MIXED = [
    [(11 * i + 5 * j) % 1000 + 4 for j in range(n)] for i, n in enumerate((8, 120, 24, 96, 40, 72, 16, 56))
]
MIXED_NEW = 96
# A batch that outgrows a small KV limit in decode: 8 requests of 48 + 96 tokens.
HEAVY = [[(7 * i + j) % 1000 + 4 for j in range(48)] for i in range(8)]
HEAVY_NEW = 96
# The data plane's page size of the engine tests' elastic pools (the host backend's granularity is 4 KiB).
SLOT = 64 << 10

# The engine settings of docs/cpu-engines.md ("SGLang on the CPU") for a tiny model.
CPU_ENGINE_KWARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_cuda_graph": True,
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "random_seed": 0,
    "log_level": "warning",
    # No busy idle loop: a waiting engine must not take a core from the one being tested (2 cores).
    "sleep_on_idle": True,
}


def engine_environ(
    extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of an SGLang CPU engine process: ``base`` (default ``os.environ``) plus the CPU
    switches, the stand-in ``sgl_kernel`` first on ``PYTHONPATH``, and ``extra`` (whose ``PYTHONPATH``, if
    any, joins the path after the stand-in and the repository instead of replacing them)."""
    env = dict(os.environ if base is None else base)
    # One compute thread: torch's OpenMP pool oversubscribes 2 shared cores and spins (20x slower here).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_NATIVE_MOVE_KV_CACHE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    extra = dict(extra or {})
    path = [str(STAND_IN), str(REPO_ROOT)]
    for more in (extra.pop("PYTHONPATH", ""), env.get("PYTHONPATH", "")):
        if more:
            path.append(more)
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra)
    return env


class EngineProcess:
    """One ``sglang.Engine(model_path=..., **kwargs)`` in a driver process; call :meth:`call` for its methods.

    ``env`` adds variables for the engine only (e.g. ``ELASTIC_KV_SGLANG_BACKEND=elastic``). The engine's
    log goes to ``log_path``. Start-up failures raise ``RuntimeError`` with the log's tail.
    """

    def __init__(
        self,
        model_path: Path,
        engine_kwargs: Mapping[str, Any],
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 -- lives as long as the engine
        engine_logs.watch(log_path, f"sglang/{log_path.name}")
        # A pipe whose child end the driver inherits by descriptor: no port, and EOF when it dies.
        self._conn: Connection | None
        self._conn, child = Pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.sglang_driver", str(child.fileno())],
            cwd=REPO_ROOT,
            env=engine_environ(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=[child.fileno()],
        )
        child.close()
        try:
            self._conn.send({"model_path": str(model_path), **dict(engine_kwargs)})
            if not self._conn.poll(start_timeout_s):
                raise TimeoutError(f"engine did not start in {start_timeout_s} s")
            reply = self._conn.recv()
        except (OSError, EOFError, TimeoutError) as exc:
            self.close()
            raise RuntimeError(f"engine failed to start: {exc!r}\n{self.log_tail()}") from exc
        if not reply.get("ok"):
            self.close()
            raise RuntimeError(f"engine failed to start: {reply.get('error')}\n{self.log_tail()}")
        self.child_pids: list[int] = reply["child_pids"]
        self.pid = self._proc.pid

    def call(self, method: str, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> Any:
        """Call ``engine.<method>(*args, **kwargs)`` in the driver; re-raise its error as ``RuntimeError``."""
        if self._conn is None:
            raise RuntimeError("engine is closed")
        self._conn.send({"method": method, "args": args, "kwargs": kwargs})
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{method} did not answer in {timeout_s} s\n{self.log_tail()}")
        reply = self._conn.recv()
        if not reply.get("ok"):
            raise RuntimeError(f"{method} failed: {reply.get('error')}\n--- log tail ---\n{self.log_tail()}")
        return reply.get("result")

    def generate(self, input_ids: list[list[int]], **sampling: Any) -> list[list[int]]:
        """Greedy (unless ``sampling`` says otherwise) generation; the output token ids of each prompt."""
        params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, **sampling}
        outs = self.call("generate", input_ids=input_ids, sampling_params=params)
        return [list(o["output_ids"]) for o in outs]

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the engine log."""
        return engine_logs.tail(self.log_path, lines)

    def close(self) -> None:
        """Shut the engine down (politely, then by force) and release the socket."""
        if self._conn is not None:
            try:
                self._conn.send({"method": "__shutdown__", "args": (), "kwargs": {}})
                self._conn.poll(60)
            except (OSError, EOFError):
                pass
            self._conn.close()
            self._conn = None
        stop_process(self._proc, terminate=False)  # the driver ends on its own after the shutdown call
        self._log.close()
        engine_logs.unwatch(self.log_path)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plugin_installed() -> bool:
    """True when the plugin's entry point is installed (SGLang loads plugins by entry point only)."""
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    return any(ep.value.startswith("sglang_elastic_kv.") for ep in eps)


def start_engine(
    name: str,
    model_path: Path,
    *,
    backend: str,
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 300.0,
    **engine_kwargs: Any,
) -> EngineProcess:
    """Start an SGLang CPU engine named ``name`` (its log: ``.cache/logs/sglang/<name>.log``).

    ``backend`` is ``"native"`` or ``"elastic"`` (exported as ``ELASTIC_KV_SGLANG_BACKEND`` to the engine
    only); ``env`` adds engine-only variables; ``engine_kwargs`` override :data:`CPU_ENGINE_KWARGS`.
    """
    kwargs = {**CPU_ENGINE_KWARGS, "max_total_tokens": 4096, **engine_kwargs}
    full_env = {"ELASTIC_KV_SGLANG_BACKEND": backend, **(env or {})}
    return EngineProcess(
        model_path, kwargs, env=full_env, log_path=LOG_DIR / f"{name}.log", start_timeout_s=start_timeout_s
    )


@dataclass(frozen=True)
class EngineKind:
    """How a test module starts its engines: the model's engine-only variables (``env``), engine arguments
    over :data:`CPU_ENGINE_KWARGS` (``kwargs``) and the start-up timeout. Its native engines give the
    reference tokens; its elastic engines serve the tests, each on a pool of its own name."""

    env: Mapping[str, str] = field(default_factory=dict)
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    start_timeout_s: float = 300.0

    def start(
        self, name: str, model: Path, backend: str, env: Mapping[str, str], **kwargs: Any
    ) -> EngineProcess:
        """Engine ``name`` of ``backend``, with ``env`` and ``kwargs`` over this kind's."""
        return start_engine(
            name,
            model,
            backend=backend,
            env={**self.env, **env},
            start_timeout_s=self.start_timeout_s,
            **{**self.kwargs, **kwargs},
        )

    def reference(
        self, name: str, model: Path, runs: Mapping[str, tuple[list[list[int]], int]], **kwargs: Any
    ) -> dict[str, list[list[int]]]:
        """A native engine's :func:`reference_outputs` for ``runs`` (the plugin installed, not enabled); the
        engine is closed before this returns."""
        with self.start(name, model, "native", {}, **kwargs) as eng:
            return reference_outputs(eng, runs)

    def elastic(
        self, name: str, model: Path, registry_dir: Path, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> EngineProcess:
        """An elastic engine whose pool ``name`` publishes in ``registry_dir`` (:func:`elastic_env`)."""
        return self.start(
            name, model, "elastic", {**elastic_env(registry_dir, name), **(env or {})}, **kwargs
        )


def elastic_env(registry_dir: Path, name: str) -> dict[str, str]:
    """The engine-only variables of an elastic test engine: pool ``name`` in ``registry_dir``, :data:`SLOT`
    pages, a snapshot published at every scheduler pass (so tests read the pool's state as it is)."""
    return {
        "ELASTIC_KV_PAGE_SIZE": str(SLOT),
        "ELASTIC_KV_REGISTRY_DIR": str(registry_dir),
        "ELASTIC_KV_POOL_NAME": name,
        "ELASTIC_KV_PUBLISH_INTERVAL_S": "0",
    }


def check_quiet_and_alive(engine: EngineProcess) -> None:
    """SGLang's idle leak check (which raises on a leak, and runs the allocators' own accounting) stayed
    quiet in ``engine``'s log, nothing raised, and the scheduler still answers."""
    log = engine.log_path.read_text()
    assert "memory leak detected" not in log
    assert "Traceback" not in log
    assert engine.call("get_server_info") is not None  # the scheduler is alive


def reference_outputs(
    engine: EngineProcess, runs: Mapping[str, tuple[list[list[int]], int]]
) -> dict[str, list[list[int]]]:
    """``engine``'s greedy outputs for each named run (prompts, new tokens per prompt); then its log must
    show no traceback and no leak report."""
    out = {key: engine.generate(prompts, max_new_tokens=new) for key, (prompts, new) in runs.items()}
    log = engine.log_path.read_text()
    assert "Traceback" not in log and "memory leak detected" not in log
    return out


def settled_snapshot(
    registry_dir: Path,
    name: str,
    pred: Callable[[PoolSnapshot], bool] = lambda s: True,
    timeout_s: float = 30.0,
) -> PoolSnapshot:
    """Pool ``name``'s published snapshot once ``pred(snapshot)`` holds, or the last one after ``timeout_s``
    (an idle scheduler publishes on its own); fails if the pool never published one."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = Registry(registry_dir).pool(name).snapshot
        if (snap is not None and pred(snap)) or time.monotonic() > deadline:
            assert snap is not None, f"pool {name} never published a snapshot"
            return snap
        time.sleep(0.05)


def kvctl(registry_dir: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``kvctl ARGS`` on ``registry_dir``, as a user beside the engine runs it."""
    return subprocess.run(
        [sys.executable, "-m", "elastic_kv.cli.kvctl", *args],
        env=engine_environ({"ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def generate_under_lowered_limit(
    engine: EngineProcess, registry_dir: Path, name: str, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Start ``prompts`` on ``engine``; once the batch holds more than two pages' worth of blocks of pool
    ``name``, lower that pool's limit (through the registry, as ``kvctl limit`` does) to one page below the
    pages that hold its live blocks.

    Returns the outputs after checking that the limit was met *while the batch still ran* (SGLang
    retracted the requests holding slots on the pages being released, and counted them in the pool's
    snapshot), that the pool then stayed within the limit until the batch ended, and that no allocation
    failed. The limit is lifted again in any case. (``kvctl``'s own report is tested in
    ``tests/limits``: started as a process here, it took seconds to apply the limit on a busy machine, and
    the batch could end first.)"""
    engine.call("flush_cache")
    page_bytes = settled_snapshot(registry_dir, name, lambda s: s.used_blocks == 0).page_bytes
    registry = Registry(registry_dir)
    result: list[Any] = []
    worker = threading.Thread(
        target=lambda: result.append(engine.generate(prompts, max_new_tokens=max_new_tokens)), daemon=True
    )
    worker.start()
    try:
        grown = settled_snapshot(
            registry_dir, name, lambda s: s.used_blocks > 2 * s.blocks_per_page, timeout_s=120
        )
        # One page fewer than the pages holding live blocks: releasing the reserve is not enough.
        in_use = grown.mapped_pages - grown.reserve_pages - grown.pending_pages - grown.inflight_pages
        limit = (in_use - 1) * page_bytes
        registry.set_limit(name, limit)
        met = settled_snapshot(
            registry_dir, name, lambda s: s.limit_bytes == limit and s.mapped_bytes <= limit, timeout_s=120
        )
        ran_on = worker.is_alive()
        assert met.limit_bytes == limit and met.mapped_bytes <= limit, f"the limit was not met: {met}"
        charges = []
        while worker.is_alive():
            charges.append(registry.pool(name).charged_bytes)
            time.sleep(0.02)
        worker.join(timeout=600)
        assert result, "the batch did not finish"
        assert ran_on, "the batch ended before the limit was met"
        retracted = (
            settled_snapshot(
                registry_dir, name, lambda s: s.preemptions > grown.preemptions, timeout_s=10
            ).preemptions
            - grown.preemptions
        )
        assert retracted >= 1, "the limit was met without a retraction"
        assert max(charges, default=0) <= limit, f"the pool grew over its limit of {limit} B again"
        log = engine.log_path.read_text()
        assert "KV cache pool is full. Retract requests." in log
        assert "Out of memory" not in log
        print(f"pool {name}: limit {limit} B met with {retracted} request(s) retracted")
    finally:
        registry.set_limit(name, 0)
    outputs: list[list[int]] = result[0]
    return outputs


def generate_watching_peaks(
    engine: EngineProcess,
    registry_dir: Path,
    names: tuple[str, ...],
    prompts: list[list[int]],
    max_new_tokens: int,
) -> tuple[list[list[int]], dict[str, int]]:
    """``engine.generate(prompts)`` while sampling the published ``mapped_bytes`` of pools ``names`` every
    10 ms; returns the outputs and each pool's peak (0 for a pool that published nothing meanwhile)."""
    registry = Registry(registry_dir)
    peak = dict.fromkeys(names, 0)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for name in names:
                snap = registry.pool(name).snapshot
                if snap is not None:
                    peak[name] = max(peak[name], snap.mapped_bytes)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = engine.generate(prompts, max_new_tokens=max_new_tokens)
    finally:
        done.set()
        watcher.join()
    return out, peak
