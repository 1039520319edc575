"""``elastic-kv serve`` with three real vLLM engines on the CPU, one server for the whole module.

Models: ``a`` (priority 1), ``b`` and ``c`` (priority 0), distinct tiny Llamas. Each counts 10 MiB of
weights (``weights_bytes``) against a 24 MiB budget, so two are awake at a time and at most two engine
processes run. ``a`` and ``b`` start; ``c`` sleeps until asked for and then takes ``b``'s place (lower
priority, least recently used). vLLM on the CPU cannot sleep through its API, so sleeping stops the engine
and waking cold-starts it ("stop" sleep mode). The tests run in file order and share the server's state:
start-up, routing, the OpenAI client, errors, a client that disconnects, eviction, idle sleep and wake, an
engine killed mid-request, and a drained shutdown that leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from elastic_kv.registry import UNLIMITED, Registry

from tests.support.models import DISTINCT_SPECS, tiny_model
from tests.support.serve import POOL_ENV, VLLM_CPU_ARGS, ServeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MiB = 1 << 20
PROMPT = "the quick brown fox jumps over the lazy dog."
LONG = 900  # tokens: many seconds of decoding on the CPU


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    paths = [tiny_model(spec) for spec in DISTINCT_SPECS]
    models = [
        {"name": name, "engine": "vllm", "model": str(path), "args": VLLM_CPU_ARGS, "env": POOL_ENV,
         "weights_bytes": "10M", "priority": prio, "idle_sleep_s": idle}
        for name, path, prio, idle in zip("abc", paths, (1, 0, 0), (0, 0, 8), strict=True)
    ]  # fmt: skip
    srv = ServeProcess(
        tmp_path_factory.mktemp("serve"),
        {"budget": "24M", "max_request_bytes": "64K", "wake_timeout_s": 600, "restart_backoff_s": 0.5},
        models,
    )
    try:
        srv.wait_for({"a": "awake", "b": "awake"})
        yield srv
    finally:
        srv.stop()


# Facts the tests hand on to later ones (they run in file order on one server).
SEEN: dict[str, Any] = {"pids": set()}


def _note_pids(status: dict[str, Any]) -> None:
    for m in status.values():
        if m["pid"]:
            SEEN["pids"].add(m["pid"])
            with contextlib.suppress(psutil.Error):
                SEEN["pids"].update(c.pid for c in psutil.Process(m["pid"]).children(recursive=True))


def _complete(
    url: str, model: str, prompt: str = PROMPT, max_tokens: int = 12, **extra: Any
) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=600)


def _tokens(reply: httpx.Response) -> list[int]:
    assert reply.status_code == 200, reply.text
    ids: list[int] = reply.json()["choices"][0]["token_ids"]
    assert len(ids) == 12
    return ids


def _engine_metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_start_up_wakes_what_fits_and_sets_the_kv_budget(server: ServeProcess) -> None:
    status = server.status()
    _note_pids(status)
    assert [status[n]["state"] for n in "abc"] == ["awake", "awake", "asleep"]
    assert status["c"]["pid"] is None and status["c"]["kv_bytes"] == 0
    assert {m["sleep_mode"] for m in status.values()} == {"stop"}  # vLLM's CPU platform cannot sleep
    assert status["a"]["kv_bytes"] > 0 and status["b"]["kv_bytes"] > 0
    registry = Registry(server.registry)
    assert {p.name for p in registry.pools()} == {"serve.a", "serve.b"}
    assert registry.device("cpu").budget_bytes == 24 * MiB - 2 * 10 * MiB  # budget - awake weights


def test_each_model_answers_as_its_engine_does_alone(server: ServeProcess) -> None:
    status = server.status()
    for name in "ab":
        routed = _tokens(_complete(server.url, name))
        direct = _tokens(_complete(f"http://127.0.0.1:{status[name]['port']}", name))
        assert routed == direct
        SEEN[f"tokens-{name}"] = routed
    assert SEEN["tokens-a"] != SEEN["tokens-b"]  # two different models behind one endpoint


def test_openai_client_streaming_and_not(server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["a", "b", "c"]
    whole = client.completions.create(model="a", prompt=PROMPT, max_tokens=12, temperature=0)
    parts = client.completions.create(model="a", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    chunks = [c.choices[0].text for c in parts if c.choices]
    assert len(chunks) > 1 and "".join(chunks) == whole.choices[0].text
    messages: Any = [{"role": "user", "content": "pages are mapped when blocks are used"}]
    chat = client.chat.completions.create(model="b", messages=messages, max_tokens=10, temperature=0)
    streamed = client.chat.completions.create(
        model="b", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert chat.choices[0].message.role == "assistant" and text == chat.choices[0].message.content


def test_concurrent_requests_to_several_models(server: ServeProcess) -> None:
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _complete(server.url, "ab"[i % 2]), range(8)))
    for i, reply in enumerate(replies):
        assert _tokens(reply) == SEEN[f"tokens-{'ab'[i % 2]}"]


def test_bad_requests_get_openai_errors(server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert info.value.status_code == 404 and "nope" in info.value.message
    bad = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "a", ', timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    no_model = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    huge = _complete(server.url, "a", prompt="x " * (40 << 10))
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "RequestTooLargeError"


def test_a_client_that_disconnects_cancels_its_upstream_request(server: ServeProcess) -> None:
    port = server.status()["b"]["port"]
    before = _engine_metric(port, "vllm:generation_tokens_total")
    body = {
        "model": "b",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=600) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.status()["b"]["in_flight"] == 0 and _engine_metric(port, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the upstream request kept running after its client left")
    generated = _engine_metric(port, "vllm:generation_tokens_total") - before
    assert generated < LONG, f"the engine generated all {generated:.0f} tokens"


def test_waking_a_model_makes_room_by_priority(server: ServeProcess) -> None:
    assert _tokens(_complete(server.url, "c"))  # c sleeps: this request waits while it wakes
    status = server.status()
    _note_pids(status)
    assert (status["a"]["state"], status["b"]["state"], status["c"]["state"]) == ("awake", "asleep", "awake")
    assert status["b"]["sleeps"] == 1 and status["a"]["sleeps"] == 0  # b: priority 0 and least recently used
    assert status["c"]["wakes"] == 1 and status["c"]["wake_p50_s"] > 0 and status["c"]["kv_bytes"] > 0
    assert status["b"]["kv_bytes"] == 0 and status["b"]["pid"] is None
    assert {p.name for p in Registry(server.registry).pools()} == {"serve.a", "serve.c"}
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'elastic_kv_serve_wake_seconds_count{level="cold",mode="stop",model="c"} 1.0' in metrics
    assert 'elastic_kv_serve_model_state{model="b",state="asleep"} 1.0' in metrics


def test_an_idle_model_sleeps_and_wakes_on_request(server: ServeProcess) -> None:
    pid = server.status()["c"]["pid"]
    status = server.wait_for({"c": "asleep"}, timeout_s=60)  # idle_sleep_s = 8
    assert status["c"]["kv_bytes"] == 0 and status["c"]["pid"] is None and not psutil.pid_exists(pid)
    assert "serve.c" not in {p.name for p in Registry(server.registry).pools()}
    assert _tokens(_complete(server.url, "b")) == SEEN["tokens-b"]  # b fits beside a: nobody sleeps
    status = server.status()
    _note_pids(status)
    assert status["b"]["state"] == "awake" and status["b"]["wakes"] == 1 and status["b"]["kv_bytes"] > 0
    assert status["a"]["state"] == "awake" and status["a"]["sleeps"] == 0


def test_an_engine_killed_mid_request_is_restarted_and_serves_the_request_again(server: ServeProcess) -> None:
    """vLLM's engine is killed while it decodes a request: nothing of the answer reached the client, so the
    router sends the request again, once; the restarted engine serves it from the start, and the other model
    is unaffected."""
    victim = server.status()["a"]["pid"]
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.update(r=_complete(server.url, "a", max_tokens=LONG)))
    thread.start()
    deadline = time.monotonic() + 60
    while server.status()["a"]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    assert _tokens(_complete(server.url, "b")) == SEEN["tokens-b"]  # the other model is unaffected
    thread.join(timeout=600)
    reply = result["r"]
    assert reply.status_code == 200, reply.text
    ids = reply.json()["choices"][0]["token_ids"]
    assert len(ids) == LONG and ids[:12] == SEEN["tokens-a"]  # greedy: the same start as before the kill
    status = server.status()
    _note_pids(status)
    assert status["a"]["state"] == "awake" and status["a"]["restarts"] == 1 and status["a"]["pid"] != victim
    assert _tokens(_complete(server.url, "a")) == SEEN["tokens-a"]


def test_shutdown_drains_requests_and_leaves_nothing_behind(server: ServeProcess) -> None:
    _note_pids(server.status())
    body = {
        "model": "b",
        "prompt": PROMPT,
        "max_tokens": 200,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    finished: list[list[str]] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=600) as reply:
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
            finished.append(
                [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
            )

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.status()["b"]["in_flight"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stop() == -signal.SIGTERM  # drained, then exited by the signal (uvicorn re-raises it)
    assert "all engines stopped" in server.log_path.read_text()
    for t in threads:
        t.join(timeout=60)
    assert finished == [["length"]] * 3  # every in-flight stream ran to its last token
    assert not [
        pid for pid in SEEN["pids"] if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]
    registry = Registry(server.registry)
    assert registry.pools() == []
    assert registry.device("cpu").budget_bytes == UNLIMITED
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)
    assert not list(Path(server.registry).glob("*.pool"))


def test_an_engine_that_cannot_start_names_its_cause_and_is_not_retried_after_the_same_failure_twice(
    tmp_path: Path,
) -> None:
    """vLLM refuses the model's arguments at start-up (a context longer than the model's): the server shows
    the engine's own error line, stops the model after the same failure twice (not ``max_restarts`` times),
    and a request for it gets 503 with that line."""
    (tmp_path / "s").mkdir()
    args = [*VLLM_CPU_ARGS, "--max-model-len", "999999"]  # the last value wins; the tiny model has 2048
    srv = ServeProcess(
        tmp_path / "s",
        {"max_restarts": 5, "restart_backoff_s": 0.2},
        [{"name": "bad", "engine": "vllm", "model": str(tiny_model(DISTINCT_SPECS[0])), "args": args,
          "env": POOL_ENV}],
    )  # fmt: skip
    try:
        status = srv.wait_for({"bad": "stopped"}, timeout_s=600)["bad"]
        assert status["restarts"] == 1, status  # the first start and one retry
        error = status["error"]
        assert "\n" not in error and "max_model_len" in error and "Error: " in error, error
        assert error.endswith("; it failed the same way twice: not restarted") and error.count("(log ") == 1
        reply = _complete(srv.url, "bad")
        assert reply.status_code == 503 and "max_model_len" in reply.json()["error"]["message"]
    finally:
        srv.stop()
