"""``elastic-kv serve``'s config contract: valid files load, unknown keys and bad values are refused with
one line naming the key, ``--model NAME=PATH`` builds the same objects, and the CLI exits non-zero."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from elastic_kv.errors import ConfigError
from elastic_kv.sizes import Percent
from elastic_kv_serve.config import load_config, parse_config, quick_config, render_config

GOOD = """
[server]
host = "0.0.0.0"
port = 9000
budget = "80%"
idle_sleep_s = 120

[[models]]
name = "llama-a"
engine = "vllm"
model = "/models/a"
args = ["--max-model-len", "4096"]
idle_sleep_s = 0
priority = 2

[[models]]
name = "org/llama-b"
engine = "sglang"
model = "/models/b"
pinned = true
weights_bytes = "16G"
env = { OMP_NUM_THREADS = "4" }
"""


def test_a_full_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(GOOD)
    cfg = load_config(path)
    assert cfg.server.host == "0.0.0.0" and cfg.server.port == 9000
    assert cfg.server.budget == Percent(80.0)
    a, b = cfg.models
    assert a.args == ["--max-model-len", "4096"] and a.priority == 2 and cfg.idle_sleep_s(a) == 0
    assert b.engine == "sglang" and b.weights_bytes == 16 << 30 and b.env == {"OMP_NUM_THREADS": "4"}
    assert cfg.idle_sleep_s(b) == 0  # pinned never sleeps
    assert b.pool_name == "serve.org_llama-b"


def test_server_defaults_apply() -> None:
    cfg = parse_config({"models": [{"name": "m", "model": "/m"}]})
    assert cfg.server.port == 8000 and cfg.server.budget is None
    assert cfg.idle_sleep_s(cfg.models[0]) == cfg.server.idle_sleep_s == 300.0


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"server": {"prot": 1}, "models": [{"name": "m", "model": "/m"}]},
         "server.prot: unknown key (did you mean port?)"),
        ({"server": {"idle_sleep": 1}, "models": [{"name": "m", "model": "/m"}]},
         "server.idle_sleep: unknown key (did you mean idle_sleep_s?)"),
        ({"sever": {}, "models": [{"name": "m", "model": "/m"}]},
         "sever: unknown key (did you mean server?)"),
        ({"server": {"api_keys": [{"key": "k", "modles": []}]}, "models": [{"name": "m", "model": "/m"}]},
         "server.api_keys[0].modles: unknown key (did you mean models?)"),
        ({"server": {"api_keys": [3]}, "models": [{"name": "m", "model": "/m"}]},
         'server.api_keys[0]: expected a key ("sk-...") or a table'),
        ({"server": {"ssl_certfile": "/c"}, "models": [{"name": "m", "model": "/m"}]},
         "ssl_certfile and ssl_keyfile go together"),
        ({"models": [{"name": "m", "model": "/m", "idle": 3}]}, "models[0].idle: unknown key"),
        ({"models": [{"name": "m", "model": "/m", "zzzz": 3}]}, "models[0].zzzz: unknown key"),
        ({"models": [{"name": "m", "model": "/m", "engine": "tgi"}]}, "models[0].engine"),
        ({"models": [{"name": "m", "model": "/m"}, {"name": "n", "model": "/n", "priority": "hi"}]},
         "models[1].priority"),
        ({"models": [{"name": "m", "model": "/m", "idle_sleep_s": -1}]}, "models[0].idle_sleep_s"),
        ({"server": {"budget": "120%"}, "models": [{"name": "m", "model": "/m"}]}, "server.budget"),
        ({"server": {"budget": "lots"}, "models": [{"name": "m", "model": "/m"}]}, "server.budget"),
        ({"server": {"port": 70000}, "models": [{"name": "m", "model": "/m"}]}, "server.port"),
        ({"models": [{"name": "m", "model": "/m", "args": "--x"}]}, "models[0].args"),
        ({"models": [{"name": "has space", "model": "/m"}]}, "models[0].name"),
        ({"models": [{"name": "m", "model": "/m"}, {"name": "m", "model": "/n"}]}, "two models are called"),
        ({"models": []}, "at least one"),
        ({"server": {}}, "models: Field required"),
        ({"server": {"host_budget": "lots"}, "models": [{"name": "m", "model": "/m"}]}, "server.host_budget"),
        ({"server": {"host_budget": 0}, "models": [{"name": "m", "model": "/m"}]}, "server.host_budget"),
        ({"server": {"max_queued": 0}, "models": [{"name": "m", "model": "/m"}]}, "server.max_queued"),
        ({"server": {"kv_headroom": "-1M"}, "models": [{"name": "m", "model": "/m"}]}, "server.kv_headroom"),
        ({"server": {"kv_share_min": "2 parts"}, "models": [{"name": "m", "model": "/m"}]},
         "server.kv_share_min"),
        ({"server": {"kv_share_min_weights": -0.5}, "models": [{"name": "m", "model": "/m"}]},
         "server.kv_share_min_weights"),
        ({"server": {"pressure_idle_s": -1}, "models": [{"name": "m", "model": "/m"}]},
         "server.pressure_idle_s"),
        ({"server": {"start_parallel": 0}, "models": [{"name": "m", "model": "/m"}]},
         "server.start_parallel"),
        ({"server": {"preload": "yes"}, "models": [{"name": "m", "model": "/m"}]}, "server.preload"),
        ({"server": {"suspend_busy": 1}, "models": [{"name": "m", "model": "/m"}]}, "server.suspend_busy"),
        ({"server": {"min_awake_s": -1}, "models": [{"name": "m", "model": "/m"}]}, "server.min_awake_s"),
        ({"server": {"max_suspend_s": 0}, "models": [{"name": "m", "model": "/m"}]}, "server.max_suspend_s"),
        ({"models": [{"name": "m", "model": "/m", "engine": "command"}]}, "needs command"),
        ({"models": [{"name": "m", "model": "/m", "engine": "command", "command": ["srv"]}]}, "{port}"),
        ({"models": [{"name": "m", "model": "/m", "engine": "command", "command": ["s", "{port}"],
                      "sleep_path": "/sleep"}]}, "sleep_path and wake_path go together"),
        ({"models": [{"name": "m", "model": "/m", "engine": "command", "command": ["s", "{port}"],
                      "demote_path": "/demote"}]}, "demote_path needs sleep_path and wake_path"),
        ({"models": [{"name": "m", "model": "/m", "engine": "command", "command": ["s", "{port}"],
                      "sleep_path": "/s", "wake_path": "/w", "demote_path": "demote"}]},
         "demote_path must be a path starting with /"),
        ({"models": [{"name": "m", "model": "/m", "demote_path": "/demote"}]}, 'for engine = "command" only'),
        ({"models": [{"name": "m", "model": "/m", "engine": "command", "command": ["s", "{port}"],
                      "health_path": "health"}]}, "must be a path starting with /"),
        ({"models": [{"name": "m", "model": "/m", "command": ["s", "{port}"]}]},
         'for engine = "command" only'),
    ],
)  # fmt: skip
def test_bad_configs_name_the_key(data: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "models.toml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("models.toml: ") and named in message


def test_host_memory_defaults_and_command_engines() -> None:
    cfg = parse_config(
        {"server": {"host_budget": "20G", "host_arena_dir": "/dev/shm", "start_parallel": 3, "preload": True},
         "models": [{"name": "m", "engine": "command", "model": "/m", "command": ["srv", "--port", "{port}"],
                     "sleep_path": "/sleep?level={level}", "wake_path": "/wake?level={level}"}]}
    )  # fmt: skip
    assert cfg.server.host_budget == 20 << 30 and cfg.server.host_arena_dir == Path("/dev/shm")
    assert (cfg.server.start_parallel, cfg.server.preload, cfg.server.max_queued) == (3, True, 256)
    assert cfg.models[0].health_path == "/health"
    assert parse_config({"models": [{"name": "m", "model": "/m"}]}).server.host_budget == Percent(40.0)


def test_malformed_toml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server\nport = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_a_rendered_config_loads_back(tmp_path: Path) -> None:
    """render_config writes what load_config reads: strings with quotes, lists, tables, booleans, numbers."""
    server = {
        "port": 8123,
        "budget": "50%",
        "preload": True,
        "api_keys": ['k"1', {"key": "k2", "models": ["a"]}],
    }
    models = [
        {"name": "a", "engine": "vllm", "model": "/m", "args": ["--x", "1"], "env": {"A": "1"}},
        {"name": "b", "engine": "sglang", "model": "/m", "idle_sleep_s": 2.5, "pinned": False},
    ]
    path = tmp_path / "models.toml"
    path.write_text(render_config(server, models))
    config = load_config(path)
    assert config.server.port == 8123 and config.server.preload is True
    assert [m.name for m in config.models] == ["a", "b"]
    assert config.models[0].args == ["--x", "1"] and config.models[0].env == {"A": "1"}
    assert config.models[1].idle_sleep_s == 2.5 and config.models[1].pinned is False
    with pytest.raises(TypeError, match="no TOML literal"):
        render_config({"port": None}, [])


def test_quick_form() -> None:
    cfg = quick_config(["a=/m/a", "b=/m/b"], "sglang", {"budget": "10G", "idle_sleep_s": 5.0})
    assert [(m.name, m.model, m.engine) for m in cfg.models] == [
        ("a", "/m/a", "sglang"),
        ("b", "/m/b", "sglang"),
    ]
    assert cfg.server.budget == 10 << 30 and cfg.server.idle_sleep_s == 5.0
    with pytest.raises(ConfigError, match=r"--model\[1\]: 'oops': expected NAME=PATH"):
        quick_config(["a=/m/a", "oops"])


def test_cli_refuses_a_bad_config_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(GOOD.replace("priority = 2", "priority = 2\nsleepy = true"))
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv_serve", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"elastic-kv: error: {path}: models[0].sleepy: unknown key (did you mean sleep_path?)"
    ]


def test_a_host_budget_the_host_cannot_give_stops_the_server_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "registry").mkdir(mode=0o700)
    path = tmp_path / "models.toml"
    path.write_text(
        f'[server]\nregistry_dir = "{tmp_path / "registry"}"\nhost_budget = "100000G"\n\n[[models]]\n'
        'name = "m"\nengine = "command"\nmodel = "/m"\ncommand = ["srv", "{port}"]\n'
        'sleep_path = "/sleep?level={level}"\nwake_path = "/wake_up?level={level}"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv_serve", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1
    assert errors[0].startswith("elastic-kv: error: server.host_budget: 97.7 TiB is more than the host")
    assert not list((tmp_path / "registry").glob("*.arena"))


def _serve(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_kv_serve", "serve", *args],
        capture_output=True, text=True, timeout=120, check=False, cwd=cwd,
    )  # fmt: skip


def test_a_model_path_that_does_not_exist_is_refused_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    done = _serve("--model", f"tiny={missing}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"elastic-kv: error: models[0].model: {missing} does not exist"
    ]
    relative = _serve("--model", "tiny=./nothing-here", cwd=tmp_path)
    assert relative.returncode == 2 and "models[0].model: ./nothing-here does not exist" in relative.stderr


def test_a_port_in_use_is_refused_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "registry").mkdir(mode=0o700)
        done = _serve(
            "--model", f"m={tmp_path}", "--port", str(port), "--registry-dir", str(tmp_path / "registry")
        )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"elastic-kv: error: server.port: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert "serving" not in done.stderr and not list((tmp_path / "registry").iterdir())
