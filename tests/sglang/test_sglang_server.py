"""``python -m sglang.launch_server --kv-cache-backend=elastic`` on the CPU: it answers ``/generate`` and the
OpenAI endpoints, ``kvctl list`` shows its pool, and lowering the pool's limit with ``kvctl limit`` while
requests run makes SGLang retract them, not crash."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from elastic_kv_serve.engines import free_port

from tests.support import engine_logs
from tests.support.models import REPO_ROOT
from tests.support.processes import stop_process, wait_healthy
from tests.support.sglang_engine import LOG_DIR, engine_environ, kvctl, plugin_installed

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not plugin_installed(), reason="sglang-elastic-kv is not installed"),
]

POOL = "server-pool"


class Server:
    """A launch_server process, its base URL, log and registry."""

    def __init__(self, model: Path, registry: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.registry = registry
        self.log_path = LOG_DIR / "server-elastic.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- closed in stop()
        # The flag alone enables the plugin: the environment carries only the CPU engine switches and
        # where the registry is.
        env = engine_environ({"ELASTIC_KV_REGISTRY_DIR": str(registry), "ELASTIC_KV_POOL_NAME": POOL})
        env.update({"ELASTIC_KV_PAGE_SIZE": str(64 << 10), "ELASTIC_KV_PUBLISH_INTERVAL_S": "0"})
        env.pop("ELASTIC_KV_SGLANG_BACKEND", None)
        argv = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
            "--attention-backend", "torch_native", "--disable-cuda-graph", "--dtype", "float32",
            "--max-total-tokens", "65536", "--page-size", "16", "--random-seed", "0",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
            "--kv-cache-backend=elastic",
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_healthy(self.proc, self.url, self.log_path, timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        return engine_logs.tail(self.log_path, lines)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    registry = tmp_path_factory.mktemp("server-registry")
    registry.chmod(0o700)
    srv = Server(tiny_model_path, registry)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _generate(srv: Server, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    resp = requests.post(f"{srv.url}/generate", json=body, timeout=600)
    resp.raise_for_status()
    out: dict[str, Any] = resp.json()
    return out


def test_generate_and_openai_endpoints(server: Server) -> None:
    out = _generate(server, [1, 2, 3, 4, 5], 16)
    assert out["meta_info"]["completion_tokens"] == 16
    text = requests.post(
        f"{server.url}/generate",
        json={"text": "the quick brown fox", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}},
        timeout=300,
    )
    assert text.status_code == 200 and isinstance(text.json()["text"], str)
    model = requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    comp = requests.post(
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": "elastic kv cache", "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    assert comp.status_code == 200, comp.text
    assert comp.json()["usage"]["completion_tokens"] <= 8
    chat = requests.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "pages are mapped when blocks are used"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=300,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"


def test_kvctl_lists_the_pool(server: Server) -> None:
    listed = kvctl(server.registry, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    pools = {p["name"]: p for p in json.loads(listed.stdout)["pools"]}
    assert POOL in pools and pools[POOL]["engine"] == "sglang"
    table = kvctl(server.registry, "list")
    assert POOL in table.stdout


def test_kvctl_limit_makes_it_retract_not_crash(server: Server) -> None:
    from elastic_kv.registry import Registry

    prompts = [[(11 * i + j) % 1000 + 4 for j in range(48)] for i in range(8)]
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def one(ids: list[int]) -> None:
        try:
            results.append(_generate(server, ids, 96))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    reg = Registry(server.registry)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        snap = reg.pool(POOL).snapshot
        if snap is not None and snap.used_blocks > 2 * snap.blocks_per_page:
            break
        time.sleep(0.02)
    assert snap is not None
    limited = kvctl(server.registry, "limit", POOL, str(3 * snap.page_bytes))
    assert limited.returncode == 0, limited.stderr
    try:
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        assert [r["meta_info"]["completion_tokens"] for r in results] == [96] * 8
        assert "KV cache pool is full. Retract requests." in server.log_path.read_text()
        assert server.proc.poll() is None
        assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        kvctl(server.registry, "limit", POOL, "unlimited")


def _pool_json(srv: Server) -> dict[str, Any]:
    listed = kvctl(srv.registry, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    pools: dict[str, dict[str, Any]] = {p["name"]: p for p in json.loads(listed.stdout)["pools"]}
    return pools[POOL]


def _settled_pool(srv: Server, pred: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    """``kvctl list --json``'s record of the pool once ``pred(snapshot)`` holds (or the last one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pool = _pool_json(srv)
        if pred(pool["snapshot"]) or time.monotonic() > deadline:
            return pool
        time.sleep(0.2)


@pytest.mark.parametrize("body", [{}, {"tags": ["kv_cache"]}], ids=["all-tags", "kv-cache-tag"])
def test_sleep_and_wake_over_http(server: Server, body: dict[str, Any]) -> None:
    """``/release_memory_occupation`` (as a controller calls it, on an idle server) returns the KV cache to
    the null page -- the prefix cache is flushed, every block and the reserve unmapped, and it stays so
    while asleep; ``/resume_memory_occupation`` wakes it and the outputs equal those before the sleep."""
    prompts = [[(13 * i + j) % 1000 + 4 for j in range(40)] for i in range(4)]
    before = [_generate(server, p, 24)["output_ids"] for p in prompts]
    busy = _settled_pool(server, lambda s: s["used_blocks"] > 0)["snapshot"]  # the prefix cache holds them
    assert busy["used_blocks"] > 0
    released = requests.post(f"{server.url}/release_memory_occupation", json=body, timeout=120)
    assert released.status_code == 200, released.text
    asleep = _settled_pool(server, lambda s: s["used_blocks"] == 0 and s["reserve_pages"] == 0)["snapshot"]
    assert asleep["used_blocks"] == 0 and asleep["reserve_pages"] == 0
    assert asleep["mapped_bytes"] <= asleep["page_bytes"]  # the null page only
    time.sleep(1.0)  # idle passes run housekeeping: asleep, it maps no reserve again
    still = _pool_json(server)["snapshot"]
    assert still["mapped_bytes"] <= still["page_bytes"], still
    resumed = requests.post(f"{server.url}/resume_memory_occupation", json=body, timeout=120)
    assert resumed.status_code == 200, resumed.text
    after = [_generate(server, p, 24)["output_ids"] for p in prompts]
    assert after == before
    assert _pool_json(server)["snapshot"]["used_blocks"] > 0  # it maps on demand again
    log = server.log_path.read_text()
    assert "Traceback" not in log and "memory leak detected" not in log


def test_kvctl_trim_returns_the_reserve_of_an_idle_engine(server: Server) -> None:
    """No request runs while ``kvctl trim`` waits: the idle scheduler applies it and answers with what came
    back (the reserve it had mapped)."""
    _generate(server, [(17 * j) % 1000 + 4 for j in range(40)], 8)
    idle = _settled_pool(server, lambda s: s["reserve_pages"] > 0)
    assert idle["snapshot"]["reserve_pages"] > 0, idle
    done = kvctl(server.registry, "trim", POOL, "--wait", "60")
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.strip().splitlines()
    assert line.startswith(f"pool {POOL}: returned ") and "reserve 0 page(s)" in line, line
    assert not line.startswith(f"pool {POOL}: returned 0 B"), line


def test_sigterm_removes_the_pool_record(server: Server) -> None:
    """Last in this module (it stops the server): SIGTERM to ``launch_server`` -- what ``docker stop`` and
    ``systemctl stop`` send -- ends every process of the engine, and the pool's record is gone without a
    later scan reclaiming it."""
    import psutil
    from elastic_kv.registry import Registry

    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    assert POOL in {p.name for p in Registry(server.registry).pools(reclaim=False)}
    server.proc.terminate()
    server.proc.wait(timeout=120)
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, alive
    assert sorted(p.name for p in server.registry.iterdir() if p.suffix == ".pool") == []
