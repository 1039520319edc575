"""The router's answers that need no engine: OpenAI-style errors for unknown models, malformed and oversize
bodies, the model list, health, status and metrics. The app is the real one; its lifespan (which starts
engines) is not entered, so every model stays asleep."""

from __future__ import annotations

from pathlib import Path

import pytest
from elastic_kv_serve.config import parse_config
from elastic_kv_serve.router import create_app
from elastic_kv_serve.supervisor import Supervisor
from fastapi.testclient import TestClient


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    (tmp_path / "registry").mkdir(mode=0o700)
    config = parse_config(
        {
            "server": {"registry_dir": str(tmp_path / "registry"), "log_dir": str(tmp_path / "logs"),
                       "max_request_bytes": 1024, "budget": "1G"},
            "models": [{"name": "a", "model": str(tmp_path), "priority": 3}, {"name": "b", "model": "hub/b"}],
        }
    )  # fmt: skip
    return TestClient(create_app(config, Supervisor(config)))


def test_unknown_model_is_an_openai_404(client: TestClient) -> None:
    reply = client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert reply.status_code == 404
    assert reply.json() == {
        "error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model",
                  "code": 404}
    }  # fmt: skip


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"model": 7}', b"\xff\xfe"])
def test_malformed_bodies_are_400(client: TestClient, body: bytes) -> None:
    reply = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "BadRequestError"


def test_oversize_bodies_are_413(client: TestClient) -> None:
    reply = client.post("/v1/completions", json={"model": "a", "prompt": "x" * 2000})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == 413


def test_models_health_status_metrics(client: TestClient) -> None:
    listed = client.get("/v1/models").json()
    assert [(m["id"], m["state"]) for m in listed["data"]] == [("a", "asleep"), ("b", "asleep")]
    assert client.get("/health").json() == {"status": "ok"}
    status = client.get("/status").json()
    assert status["budget_bytes"] == 1 << 30 and status["used_bytes"] == 0
    a, b = status["models"]
    assert (a["name"], a["priority"], a["pool"], a["pid"], a["wakes"]) == ("a", 3, "serve.a", None, 0)
    assert b["weights_bytes"] == 0  # a hub id without a local checkpoint: unknown until configured
    metrics = client.get("/metrics").text
    assert 'elastic_kv_serve_model_state{model="a",state="asleep"} 1.0' in metrics
    assert "elastic_kv_serve_budget_bytes 1.073741824e+09" in metrics
