"""Who may use the server and how much: API keys, per-key models, probes, token and concurrency limits, the
metrics routers read, TLS, and the refusal to listen beyond loopback without a key.

Most tests use the real app without its lifespan (no engine starts; every model stays asleep), as the
router tests do; TLS, the command line's refusals and the concurrency limit run a real server process with
toy engines (``tests/support/toy_engine.py``).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from elastic_kv.errors import ConfigError
from elastic_kv_serve.auth import ENV_KEY, check_exposure, load_keys
from elastic_kv_serve.config import parse_config
from elastic_kv_serve.router import create_app
from elastic_kv_serve.supervisor import Supervisor
from fastapi.testclient import TestClient

from tests.support.models import REPO_ROOT
from tests.support.serve import ServeProcess
from tests.support.toy_engine import answer, make_checkpoint

MiB = 1 << 20
TOY = str(REPO_ROOT / "tests" / "support" / "toy_engine.py")
LOOPBACK = ipaddress.ip_address("127.0.0.1")


def _config(tmp_path: Path, **server: Any) -> Any:
    (tmp_path / "registry").mkdir(mode=0o700, exist_ok=True)
    return parse_config(
        {
            "server": {"registry_dir": str(tmp_path / "registry"), "log_dir": str(tmp_path / "logs"),
                       "budget": "1G", **server},
            "models": [{"name": "a", "model": str(tmp_path)}, {"name": "b", "model": str(tmp_path)}],
        }
    )  # fmt: skip


def _client(tmp_path: Path, environ: dict[str, str] | None = None, **server: Any) -> TestClient:
    config = _config(tmp_path, **server)
    return TestClient(create_app(config, Supervisor(config), load_keys(config.server, environ or {})))


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ---------------------------------------------------------------------------------------------- API keys


@pytest.fixture
def keyed(tmp_path: Path) -> TestClient:
    (tmp_path / "keys").write_text("# one key a line\n\nk-file\n")
    return _client(
        tmp_path,
        {ENV_KEY: "k-env"},
        api_keys=["k-all", {"key": "k-only-a", "models": ["a"]}],
        api_key_file=str(tmp_path / "keys"),
    )


@pytest.mark.parametrize("path", ["/v1/models", "/status"])
@pytest.mark.parametrize("headers", [{}, _bearer("wrong"), {"authorization": "k-all"}, _bearer("")])
def test_without_a_valid_key_every_route_but_the_probes_is_401(
    keyed: TestClient, path: str, headers: dict[str, str]
) -> None:
    reply = keyed.get(path, headers=headers)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert reply.json()["error"]["type"] == "AuthenticationError"
    body = keyed.post("/v1/completions", json={"model": "a", "prompt": "x"}, headers=headers)
    assert body.status_code == 401  # refused before the body is read or a model woken


def test_the_probes_and_metrics_need_no_key(keyed: TestClient) -> None:
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/ready").status_code == 503  # the lifespan (start-up) has not run in this client
    assert keyed.get("/metrics").status_code == 200  # scrapers and routers read it


def test_metrics_need_a_key_unless_public(tmp_path: Path) -> None:
    client = _client(tmp_path, api_keys=["k"], public_metrics=False)
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=_bearer("k")).status_code == 200
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("key", ["k-all", "k-file", "k-env"])
def test_keys_from_the_config_the_key_file_and_the_environment_work(keyed: TestClient, key: str) -> None:
    listed = keyed.get("/v1/models", headers=_bearer(key))
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["a", "b"]
    assert keyed.get("/status", headers=_bearer(key)).status_code == 200


def test_a_key_limited_to_some_models_sees_only_those(keyed: TestClient) -> None:
    listed = keyed.get("/v1/models", headers=_bearer("k-only-a")).json()
    assert [m["id"] for m in listed["data"]] == ["a"]
    reply = keyed.post("/v1/completions", json={"model": "b", "prompt": "x"}, headers=_bearer("k-only-a"))
    assert reply.status_code == 404 and reply.json()["error"]["message"] == "The model `b` does not exist."


def test_key_files_that_cannot_serve_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_keys(_config(tmp_path, api_key_file=str(tmp_path / "missing")).server, {})
    (tmp_path / "empty").write_text("# no key\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_keys(_config(tmp_path, api_key_file=str(tmp_path / "empty")).server, {})
    with pytest.raises(ConfigError, match="cannot be empty"):
        load_keys(_config(tmp_path).server, {}, extra=[" "])
    with pytest.raises(ConfigError, match=r"api_keys\[0\]: no model is called 'zz'"):
        _config(tmp_path, api_keys=[{"key": "k", "models": ["zz"]}])


@pytest.mark.parametrize(
    ("host", "keys", "allow", "refused"),
    [
        ("127.0.0.1", [], False, False),
        ("::1", [], False, False),
        ("localhost", [], False, False),
        ("0.0.0.0", [], False, True),
        ("10.1.2.3", [], False, True),
        ("my-host", [], False, True),
        ("0.0.0.0", ["k"], False, False),
        ("0.0.0.0", [], True, False),
    ],
)
def test_listening_beyond_loopback_needs_a_key_or_an_explicit_yes(
    tmp_path: Path, host: str, keys: list[str], allow: bool, refused: bool
) -> None:
    server = _config(tmp_path, host=host, api_keys=keys, allow_unauthenticated=allow).server
    if refused:
        with pytest.raises(ConfigError, match="no API key is configured"):
            check_exposure(server, load_keys(server, {}))
    else:
        check_exposure(server, load_keys(server, {}))


def test_the_command_line_refuses_an_open_server_on_the_network(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv_serve", "serve", "--model", f"m={tmp_path}", "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("elastic-kv: error: server.host: 0.0.0.0 is reachable beyond this machine")


# ---------------------------------------------------------------------------------------------- limits


def test_a_request_for_more_tokens_than_allowed_is_400(tmp_path: Path) -> None:
    client = _client(tmp_path, max_tokens=100)
    for path, field in (("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens")):
        reply = client.post(path, json={"model": "a", "prompt": "x", field: 101})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert (
            error["param"] == field
            and error["message"] == f"{field} is 101, more than this server allows (100)"
        )


def test_router_metrics_under_vllms_names(tmp_path: Path) -> None:
    text = _client(tmp_path).get("/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{model_name="a"}} 0.0' in text and f'{name}{{model_name="b"}} 0.0' in text


def _toy(tmp_path: Path, name: str, seed: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "engine": "command", "model": str(make_checkpoint(tmp_path / name, MiB, seed)),
        "command": [sys.executable, TOY, "--port", "{port}", "--model", "{model}", "--token-ms", "100"],
        "idle_sleep_s": 0, **extra,
    }  # fmt: skip


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[ServeProcess]:
    (tmp_path / "serve").mkdir()
    srv = ServeProcess(
        tmp_path / "serve",
        {"max_in_flight": 2, "max_queued": 3, "wake_timeout_s": 60, "max_tokens": 50, "api_keys": ["k"]},
        [_toy(tmp_path, "a", 1), _toy(tmp_path, "b", 2, max_in_flight=0)],
        headers=_bearer("k"),
    )
    try:
        srv.wait_for({"a": "awake", "b": "awake"}, timeout_s=60)
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/ready", timeout=10).status_code != 200:  # a probe: no key
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.1)
        yield srv
    finally:
        srv.stop()


def _complete(srv: ServeProcess, model: str, n: int, prompt: str = "p") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": n}
    return httpx.post(f"{srv.url}/v1/completions", json=body, headers=_bearer("k"), timeout=60)


def test_a_model_serves_max_in_flight_requests_at_once_and_queues_the_rest(
    limited: ServeProcess, tmp_path: Path
) -> None:
    """``a`` serves two 2 s requests at a time (the others wait in its queue, at most three: the sixth is
    429); ``b`` (its own limit: none) serves all of its requests at once."""
    with ThreadPoolExecutor(8) as pool:
        replies = [pool.submit(_complete, limited, "a", 20, f"p{i}") for i in range(5)]
        deadline = time.monotonic() + 20
        while (a := limited.status()["a"])["in_flight"] + a["queued"] < 5:
            assert time.monotonic() < deadline, a
            time.sleep(0.05)
        assert (a["in_flight"], a["queued"]) == (2, 3)
        text = httpx.get(f"{limited.url}/metrics", headers=_bearer("k"), timeout=10).text
        assert 'vllm:num_requests_running{model_name="a"} 2.0' in text
        assert 'vllm:num_requests_waiting{model_name="a"} 3.0' in text
        over = _complete(limited, "a", 20, "p5")
        assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
        many = [pool.submit(_complete, limited, "b", 10, f"q{i}") for i in range(3)]
        deadline = time.monotonic() + 20
        while limited.status()["b"]["in_flight"] < 3:
            assert time.monotonic() < deadline, limited.status()["b"]
            time.sleep(0.05)
        weights = (tmp_path / "a" / "weights.bin").read_bytes()
        for i, reply in enumerate(replies):
            assert reply.result().json()["choices"][0]["text"] == answer(f"p{i}", weights, 20)
        assert all(f.result().status_code == 200 for f in many)
    assert _complete(limited, "a", 51).status_code == 400  # max_tokens


# ---------------------------------------------------------------------------------------------- TLS


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, written to ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elastic-kv test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    crt, pem = folder / "tls.crt", folder / "tls.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    pem.chmod(0o600)
    return crt, pem


def test_https_with_a_key_and_the_status_command(tmp_path: Path) -> None:
    crt, pem = _self_signed(tmp_path)
    (tmp_path / "serve").mkdir()
    srv = ServeProcess(
        tmp_path / "serve",
        {"ssl_certfile": str(crt), "ssl_keyfile": str(pem), "api_keys": ["k"]},
        [_toy(tmp_path, "a", 1)],
        headers=_bearer("k"),
        verify=ssl.create_default_context(cafile=crt),
    )
    try:
        srv.wait_for({"a": "awake"}, timeout_s=60)
        body = {"model": "a", "prompt": "tls", "max_tokens": 3}
        reply = srv.client.post("/v1/completions", json=body)
        assert reply.json()["choices"][0]["text"] == answer(
            "tls", (tmp_path / "a" / "weights.bin").read_bytes(), 3
        )
        with pytest.raises(httpx.ConnectError):  # an unverified certificate is refused by default
            httpx.get(f"{srv.url}/health", timeout=10)
        plain = srv.url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{plain}/health", timeout=10)
        status = subprocess.run(
            [sys.executable, "-m", "elastic_kv_serve", "status", "--url", srv.url, "--cacert", str(crt),
             "--api-key", "k"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0 and "awake" in status.stdout, status.stderr
        refused = subprocess.run(
            [sys.executable, "-m", "elastic_kv_serve", "status", "--url", srv.url, "--cacert", str(crt)],
            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert refused.returncode == 1 and "401" in refused.stderr
        no_ca = subprocess.run(
            [sys.executable, "-m", "elastic_kv_serve", "status", "--url", srv.url, "--cacert", f"{pem}.x"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert no_ca.returncode == 2 and no_ca.stderr.startswith("elastic-kv status: --cacert"), no_ca.stderr
    finally:
        srv.stop()


def test_a_certificate_that_does_not_load_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.crt").write_text("not a certificate\n")
    (tmp_path / "bad.key").write_text("not a key\n")
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv_serve", "serve", "--model", f"m={tmp_path}", "--ssl-certfile",
         str(tmp_path / "bad.crt"), "--ssl-keyfile", str(tmp_path / "bad.key")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("elastic-kv: error: server.ssl_certfile: cannot serve TLS with")
