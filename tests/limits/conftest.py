"""Fixtures of the limits tests: a private registry per test, real pool-owning processes, kvctl runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import elastic_kv
import pytest

from limits.helpers import PoolProcess

# Where `elastic_kv` is imported from here: child processes get the same tree (installed or a checkout).
PACKAGE_ROOT = Path(elastic_kv.__file__).resolve().parents[1]


@pytest.fixture
def registry_dir(tmp_path: Path) -> Path:
    """A registry directory of this test only (created by the code under test)."""
    return tmp_path / "registry"


@pytest.fixture
def child_env(registry_dir: Path) -> dict[str, str]:
    """Environment for child processes: this test's registry, this checkout's package, a wide terminal."""
    env = dict(os.environ)
    env["ELASTIC_KV_REGISTRY_DIR"] = str(registry_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env["COLUMNS"] = "220"
    return env


@pytest.fixture
def spawn_pool(child_env: dict[str, str]) -> Iterator[Callable[..., PoolProcess]]:
    """Start pool-owning processes; every one still running at the end of the test is killed."""
    started: list[PoolProcess] = []

    def spawn(name: str, **options: Any) -> PoolProcess:
        worker = PoolProcess(child_env, name, **options)
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        if worker.proc.poll() is None:
            worker.kill()
        for stream in (worker.proc.stdin, worker.proc.stdout, worker.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def kvctl(child_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real CLI (``python -m elastic_kv.cli.kvctl``) in a child process against this test's
    registry."""

    def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "elastic_kv.cli.kvctl", *args],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run
