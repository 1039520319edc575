"""``--kv-cache-backend`` on SGLang's real argument parser (``prepare_server_args``, as ``launch_server``
and ``sglang serve`` call it), in fresh processes that load the installed plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support.models import REPO_ROOT
from tests.support.sglang_engine import plugin_installed

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not plugin_installed(), reason="sglang-elastic-kv is not installed"),
]

BASE = ["--model-path", "/nonexistent/model", "--page-size", "16"]
CASES = [
    BASE,
    [*BASE, "--kv-cache-backend=elastic"],
    [*BASE, "--kv-cache-backend", "native"],
    [*BASE, "--kv-cache-backend=bogus"],
    ["--help"],
]


def _probe(argvs: list[list[str]], **env: str) -> list[dict[str, Any]]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_KV_")}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.sglang_cli_probe", json.dumps(argvs)],
        cwd=REPO_ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def with_plugin() -> list[dict[str, Any]]:
    return _probe(CASES)


@pytest.fixture(scope="module")
def without_plugin() -> list[dict[str, Any]]:
    # SGLANG_PLUGINS is SGLang's allow-list of plugin names: a name nobody uses loads no plugin.
    return _probe([BASE], SGLANG_PLUGINS="no-such-plugin")


def test_flag_absent_changes_nothing(
    with_plugin: list[dict[str, Any]], without_plugin: list[dict[str, Any]]
) -> None:
    plain = with_plugin[0]
    assert plain["exit"] is None and plain["env"] is None
    assert plain["fields"] == without_plugin[0]["fields"]


def test_flag_is_exported_and_leaves_server_args_alone(
    with_plugin: list[dict[str, Any]], without_plugin: list[dict[str, Any]]
) -> None:
    elastic, native = with_plugin[1], with_plugin[2]
    assert elastic["exit"] is None, elastic
    assert elastic["env"] == "elastic"
    assert native["env"] == "native"
    # ServerArgs has no field for the flag: the parsed record is the same as without the plugin.
    assert elastic["fields"] == without_plugin[0]["fields"]


def test_bad_choice_is_an_argparse_error(with_plugin: list[dict[str, Any]]) -> None:
    bogus = with_plugin[3]
    assert bogus["exit"] == 2
    assert "invalid choice: 'bogus'" in bogus["stderr"]


def test_help_lists_the_flag(with_plugin: list[dict[str, Any]]) -> None:
    help_ = with_plugin[4]
    assert help_["exit"] == 0
    assert "--kv-cache-backend {native,elastic}" in help_["stdout"]


def test_flag_unknown_without_plugin() -> None:
    out = _probe([[*BASE, "--kv-cache-backend=elastic"]], SGLANG_PLUGINS="no-such-plugin")[0]
    assert out["exit"] == 2
    assert "unrecognized arguments: --kv-cache-backend=elastic" in out["stderr"]


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("ELASTIC_KV_PAGE_SIZE", "3", "e.g. 2M"),
        ("ELASTIC_KV_LIMIT", "-1", "it is negative"),
    ],
)
def test_bad_setting_stops_launch_server_with_one_line(variable: str, value: str, expected: str) -> None:
    """``python -m sglang.launch_server --kv-cache-backend=elastic`` with a bad pool setting ends in the
    launcher, before a scheduler is spawned or the model is read (the path does not exist)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_KV_")}
    environ[variable] = value
    done = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *BASE, "--kv-cache-backend=elastic"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("sglang-elastic-kv:")]
    assert len(ours) == 1, done.stderr[-3000:]
    assert variable in ours[0] and repr(value) in ours[0] and expected in ours[0], ours[0]
    assert "Traceback" not in done.stderr
