"""``elastic-kv serve`` with a real SGLang engine on the CPU (``--device cpu``, the sgl_kernel stand-in): the
router forwards to it and answers exactly as the engine does when asked directly, streaming too; its pool is
in the server's registry under the model's pool name; the sleep mode is ``stop`` (no memory saver on the
CPU); after a drained shutdown no process or pool record is left."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest
from elastic_kv.registry import Registry

from tests.support.models import DISTINCT_SPECS, tiny_model
from tests.support.serve import SGLANG_CPU_ARGS, ServeProcess, sglang_cpu_env
from tests.support.sglang_engine import plugin_installed

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not plugin_installed(), reason="sglang-elastic-kv is not installed"),
]

PROMPT = "pages are mapped when blocks are used"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    model = {"name": "s", "engine": "sglang", "model": str(tiny_model(DISTINCT_SPECS[2])),
             "args": SGLANG_CPU_ARGS, "env": sglang_cpu_env(), "idle_sleep_s": 0}  # fmt: skip
    srv = ServeProcess(tmp_path_factory.mktemp("serve-sglang"), {"wake_timeout_s": 600}, [model])
    try:
        srv.wait_for({"s": "awake"})
        yield srv
    finally:
        srv.stop()


def _greedy_text(url: str) -> str:
    body = {"model": "s", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    assert data["usage"]["completion_tokens"] == 12
    text: str = data["choices"][0]["text"]
    return text


def test_routes_to_sglang_like_the_engine_alone(server: ServeProcess) -> None:
    status = server.status()["s"]
    assert status["engine"] == "sglang" and status["sleep_mode"] == "stop" and status["kv_bytes"] > 0
    assert _greedy_text(server.url) == _greedy_text(f"http://127.0.0.1:{status['port']}")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model="s", prompt=PROMPT, max_tokens=12, temperature=0)
    parts = client.completions.create(model="s", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole.choices[0].text
    pools = {p.name: p for p in Registry(server.registry).pools()}
    assert pools["serve.s"].engine == "sglang"


def test_an_idle_engine_does_not_spin(server: ServeProcess) -> None:
    """With ``--sleep-on-idle`` (in the project's SGLang CPU arguments) an idle SGLang engine's processes
    take well under a core, where its scheduler's busy loop would take a whole one."""
    import time

    pid = server.status()["s"]["pid"]
    family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    time.sleep(2.0)  # the last request's tail work is done

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in family if p.is_running())

    before, t0 = cpu(), time.monotonic()
    time.sleep(4.0)
    share = (cpu() - before) / (time.monotonic() - t0)
    assert share < 0.35, f"the idle engine took {share:.0%} of a core"


def test_shutdown_leaves_nothing_behind(server: ServeProcess) -> None:
    pid = server.status()["s"]["pid"]
    family = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    assert server.stop() == -signal.SIGTERM  # drained, then exited by the signal (uvicorn re-raises it)
    assert "all engines stopped" in server.log_path.read_text()
    assert not [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert Registry(server.registry).pools() == []
