"""Hostile input on the HTTP API: whatever a client sends, the server answers with a documented status and an
OpenAI error body, never a 500, and its books stay balanced (nothing counted in flight or queued after).

Property-based (hypothesis) on the real app without its lifespan, as the router tests run it: no engine
starts, and the two models' weights exceed the budget, so a request that gets past validation waits for a
room that never comes and is answered 503 at ``wake_timeout_s``. Slow and vanishing clients run against a
real server process with a toy engine.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from elastic_kv_serve.auth import load_keys
from elastic_kv_serve.config import parse_config
from elastic_kv_serve.router import create_app
from elastic_kv_serve.supervisor import Supervisor
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.models import REPO_ROOT
from tests.support.serve import ServeProcess
from tests.support.toy_engine import answer, make_checkpoint

ANSWERS = {200, 400, 401, 404, 405, 413, 422, 429, 503}  # 405/422: FastAPI's own, for a wrong method or path

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
)
_bodies = st.one_of(
    _json,
    st.fixed_dictionaries(
        {"model": st.sampled_from(["a", "b", "nope", "", "a" * 300, "ü\x00"]) | st.text()},
        optional={
            "prompt": _json,
            "messages": _json,
            "max_tokens": _numbers,
            "max_completion_tokens": _numbers,
            "stream": _json,
            "n": _numbers,
            "temperature": _numbers,
        },
    ),
)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Supervisor]]:
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "registry").mkdir(mode=0o700)
    config = parse_config(
        {
            "server": {"registry_dir": str(tmp / "registry"), "log_dir": str(tmp / "logs"), "budget": "1M",
                       "wake_timeout_s": 0.05, "max_request_bytes": 4096, "max_tokens": 1000,
                       "max_queued": 64, "api_keys": ["k"]},
            "models": [{"name": n, "model": str(tmp), "weights_bytes": "2M"} for n in ("a", "b")],
        }
    )  # fmt: skip
    sup = Supervisor(config, poll_s=0.01)
    with TestClient(
        create_app(config, sup, load_keys(config.server, {})), raise_server_exceptions=False
    ) as c:
        yield c, sup


def _check(reply: httpx.Response) -> None:
    assert reply.status_code in ANSWERS, (reply.status_code, reply.text)
    if reply.status_code != 200:
        error = reply.json().get("error") if reply.status_code not in (405, 422) else None
        assert error is None or set(error) == {"message", "type", "param", "code"}


def _balanced(sup: Supervisor) -> None:
    deadline = time.monotonic() + 5
    while any(rt.queued or rt.in_flight for rt in sup.fleet.models.values()):
        assert time.monotonic() < deadline, [
            (rt.name, rt.queued, rt.in_flight) for rt in sup.fleet.models.values()
        ]
        time.sleep(0.01)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_any_json_body_gets_a_documented_answer(
    app: tuple[TestClient, Supervisor], body: Any, path: str
) -> None:
    client, sup = app
    headers = {"authorization": "Bearer k", "content-type": "application/json"}
    # Python's encoder: NaN and Infinity as bare words, which Python's decoder (the server's) accepts
    _check(client.post(path, content=json.dumps(body).encode(), headers=headers))
    _balanced(sup)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=st.binary(max_size=6000),
    content_type=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]),
    auth=st.sampled_from(["Bearer k", "Bearer K", "bearer k", "Basic k", "", "Bearer " + "k" * 5000]),
)
def test_any_bytes_and_headers_get_a_documented_answer(
    app: tuple[TestClient, Supervisor], raw: bytes, content_type: str, auth: str
) -> None:
    client, sup = app
    headers = {"content-type": content_type, "authorization": auth}
    _check(client.post("/v1/completions", content=raw, headers=headers))
    _balanced(sup)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%"), max_size=40
    ),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
)
def test_any_path_and_method_get_a_documented_answer(
    app: tuple[TestClient, Supervisor], path: str, method: str
) -> None:
    client, sup = app
    reply = client.request(method, "/" + path.lstrip("/"), headers={"authorization": "Bearer k"})
    assert reply.status_code in ANSWERS | {200}, (reply.status_code, reply.text)
    _balanced(sup)


def test_the_server_still_answers_after_the_storm(app: tuple[TestClient, Supervisor]) -> None:
    client, sup = app
    assert client.get("/health").json() == {"status": "ok"}
    status = client.get("/status", headers={"authorization": "Bearer k"}).json()
    assert [m["state"] for m in status["models"]] == ["asleep", "asleep"]
    assert not sup.fleet.closing


# ------------------------------------------------------------------------------------ slow and lost clients


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, bytes]]:
    tmp = tmp_path_factory.mktemp("slow")
    model = make_checkpoint(tmp / "toy", 1 << 20, 5)
    toy = str(REPO_ROOT / "tests" / "support" / "toy_engine.py")
    srv = ServeProcess(
        tmp,
        {"max_request_bytes": 4096},
        [{"name": "a", "engine": "command", "model": str(model), "idle_sleep_s": 0,
          "command": [sys.executable, toy, "--port", "{port}", "--model", "{model}"]}],
    )  # fmt: skip
    try:
        srv.wait_for({"a": "awake"}, timeout_s=60)
        yield srv, (model / "weights.bin").read_bytes()
    finally:
        srv.stop()


def _raw(srv: ServeProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def test_clients_that_stall_or_vanish_mid_request_leave_the_server_serving(
    server: tuple[ServeProcess, bytes],
) -> None:
    srv, weights = server
    body = json.dumps({"model": "a", "prompt": "still here", "max_tokens": 3}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    stalled = []
    for _ in range(8):  # promise a body, send part of it, then stall
        sock = _raw(srv)
        sock.sendall(head + f"content-length: {len(body)}\r\n\r\n".encode() + body[:10])
        stalled.append(sock)
    for cut in (5, len(head) + 3):  # vanish mid-headers, mid-body
        sock = _raw(srv)
        sock.sendall((head + f"content-length: {len(body)}\r\n\r\n".encode() + body)[:cut])
        sock.close()
    huge = _raw(srv)  # a declared body over max_request_bytes: refused without reading it
    huge.sendall(head + b"content-length: 99999999\r\n\r\n")
    assert huge.recv(64).startswith(b"HTTP/1.1 413")
    huge.close()
    reply = srv.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reply.json()["choices"][0]["text"] == answer("still here", weights, 3)
    for sock in stalled:
        sock.close()
    deadline = time.monotonic() + 10
    while (a := srv.status()["a"])["in_flight"] or a["queued"]:
        assert time.monotonic() < deadline, a
        time.sleep(0.1)
    assert srv.proc.poll() is None and srv.status()["a"]["state"] == "awake"
