"""The example deployment of ``examples/kubernetes``: its files parse, its config is a valid server config
that passes the server's own start-up checks, and its parts refer to each other consistently (ports,
probes, mounts, labels, the key's secret, the drain against the grace period, the arena's memory). No
cluster runs here: nothing is applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from elastic_kv.sizes import parse_size
from elastic_kv_serve.auth import check_exposure, load_keys
from elastic_kv_serve.config import parse_config

from tests.support.models import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "kubernetes"


def _docs(name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((EXAMPLE / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def serve() -> dict[str, dict[str, Any]]:
    return _docs("elastic-kv-serve.yaml")


def _container(serve: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = serve["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _bytes(quantity: str) -> int:
    """A Kubernetes binary quantity (``160Gi``) in bytes."""
    assert quantity.endswith("i"), quantity
    return parse_size(quantity.removesuffix("i"))


def _mount(container: dict[str, Any], path: str) -> dict[str, Any]:
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"])]
    return mount


def test_the_config_is_one_the_server_starts_with(serve: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    config = parse_config(tomllib.loads(serve["ConfigMap"]["data"]["models.toml"]), "models.toml")
    srv = config.server
    assert srv.host == "0.0.0.0" and srv.api_key_file is not None
    secret = serve["Secret"]["stringData"]
    (tmp_path / srv.api_key_file.name).write_text(secret[srv.api_key_file.name] + "\n")
    local = srv.model_copy(update={"api_key_file": tmp_path / srv.api_key_file.name})
    check_exposure(local, load_keys(local, {}))  # reachable beyond loopback, with a key: it starts


def test_the_parts_refer_to_each_other(serve: dict[str, dict[str, Any]]) -> None:
    config = parse_config(tomllib.loads(serve["ConfigMap"]["data"]["models.toml"]), "models.toml")
    srv = config.server
    pod = serve["Deployment"]["spec"]["template"]
    container = _container(serve)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    # the config: mounted where the command reads it
    path = container["command"][container["command"].index("--config") + 1]
    mount = _mount(container, path)
    assert volumes[mount["name"]]["configMap"]["name"] == serve["ConfigMap"]["metadata"]["name"]
    assert mount["subPath"] in serve["ConfigMap"]["data"]
    # the key: the secret's entry, mounted where api_key_file points
    assert srv.api_key_file is not None
    keys = _mount(container, str(srv.api_key_file))
    assert volumes[keys["name"]]["secret"]["secretName"] == serve["Secret"]["metadata"]["name"]
    assert srv.api_key_file.name in serve["Secret"]["stringData"]
    # ports and probes
    (port,) = container["ports"]
    assert port["containerPort"] == srv.port
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port["name"]}
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    # a drain that ends before Kubernetes kills the pod
    assert pod["spec"]["terminationGracePeriodSeconds"] > srv.drain_timeout_s
    # the arena and the registry on a memory-backed volume that holds the host budget
    assert srv.host_arena_dir is not None and srv.registry_dir is not None
    shm = _mount(container, str(srv.host_arena_dir))
    assert _mount(container, str(srv.registry_dir)) == shm
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    # host percentages are of the pod's memory limit (a container sees the node's), which the arena fits
    limit = _bytes(container["resources"]["limits"]["memory"])
    assert srv.host_memory == limit and srv.host_budget is not None and not isinstance(srv.host_budget, int)
    assert srv.host_budget.of(limit) <= _bytes(volumes[shm["name"]]["emptyDir"]["sizeLimit"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the models' checkpoints come from the models volume
    models = _mount(container, "/models/")
    assert all(m.model.startswith(models["mountPath"]) for m in config.models)
    # the Service selects the pods and targets the port
    labels = pod["metadata"]["labels"]
    assert serve["Deployment"]["spec"]["selector"]["matchLabels"] == labels
    service = serve["Service"]["spec"]
    assert service["selector"] == labels and service["ports"][0]["targetPort"] == port["name"]


def test_the_inference_pool_selects_the_same_pods(serve: dict[str, dict[str, Any]]) -> None:
    pool = _docs("inferencepool.yaml")
    spec = pool["InferencePool"]["spec"]
    assert pool["InferencePool"]["apiVersion"] == "inference.networking.k8s.io/v1"
    assert spec["selector"]["matchLabels"] == serve["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert spec["targetPorts"] == [{"number": _container(serve)["ports"][0]["containerPort"]}]
    (rule,) = pool["HTTPRoute"]["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["InferencePool"]["metadata"]["name"])
