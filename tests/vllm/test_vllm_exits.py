"""Stopping ``vllm serve ... --kv-cache-backend=elastic``: what its processes leave behind.

* SIGTERM or SIGINT to the API server (what ``systemctl stop``, ``docker stop`` and Ctrl-C send): once
  every process of the engine has exited, its pool record and its ranks' sockets are gone, without any
  later scan (``kvctl``) having to reclaim them, and the device's charge is back to zero.
* SIGKILL of every process of the engine (the OOM killer, ``kill -9``): nothing runs in them, so the
  record stays, but the next charge that needs its bytes reclaims it at once.

Each test starts its own server (tiny model) with a private registry and socket directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests
from elastic_kv.registry import DeviceBudget, PoolRecord, Registry
from elastic_kv_serve.engines import free_port
from vllm_engines import CAPACITY, TEST_ENV, tiny_model, wait_for

from tests.support.processes import wait_healthy

pytestmark = pytest.mark.vllm

POOL = "test-exits"


class Server:
    """One ``vllm serve`` process tree with its own registry and socket directories."""

    def __init__(self, root: Path) -> None:
        self.registry_dir = root / "registry"
        self.tmp = Path(tempfile.mkdtemp(prefix="ekv-"))  # short: a socket path has at most 107 bytes
        self.port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model()),
               "--kv-cache-backend", "elastic", "--additional-config.elastic_kv.pool_name", POOL,
               "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
               "--kv-cache-memory-bytes", str(CAPACITY), "--port", str(self.port)]  # fmt: skip
        env = {**os.environ, **TEST_ENV, "ELASTIC_KV_REGISTRY_DIR": str(self.registry_dir),
               "TMPDIR": str(self.tmp), "HF_HUB_OFFLINE": "1"}  # fmt: skip
        self.log = root / "server.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_healthy(self.proc, self.url, self.log, 600)
        except BaseException:  # leave no engine behind
            with contextlib.suppress(psutil.NoSuchProcess):
                top = psutil.Process(self.proc.pid)
                for process in [top, *top.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
            self.proc.wait(timeout=30)
            raise
        top = psutil.Process(self.proc.pid)
        # psutil.Process remembers each start time: a reused PID is never signalled by mistake.
        self.processes = [top, *top.children(recursive=True)]
        self.tree = [p.pid for p in self.processes]

    def complete(self) -> None:
        body = {"model": str(tiny_model()), "prompt": "a b c d e f", "max_tokens": 8, "temperature": 0.0}
        reply = requests.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text

    def sockets(self) -> list[Path]:
        return sorted(self.tmp.glob("elastic-kv-*/*.sock"))

    def pool_files(self) -> list[Path]:
        return sorted(self.registry_dir.glob("*.pool"))

    def all_gone(self) -> bool:
        return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in self.processes)

    def kill_all(self) -> None:
        for process in self.processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    try:
        yield srv
    finally:
        srv.kill_all()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_server_removes_its_records_and_sockets(server: Server, sig: signal.Signals) -> None:
    server.complete()
    assert [p.name for p in server.pool_files()] == [f"{POOL}.pool"]
    assert server.sockets(), "the worker's rank listens on a socket"
    assert Registry(server.registry_dir).device("cpu").charged_bytes > 0
    server.proc.send_signal(sig)
    server.proc.wait(timeout=120)
    assert wait_for(server.all_gone, timeout=60), "engine processes outlived the server"
    # Straight from the directory, before anything scans it: the processes removed their own files.
    assert server.pool_files() == [], f"pool records left behind; see {server.log}"
    assert server.sockets() == [], f"sockets left behind; see {server.log}"
    budget = DeviceBudget.open(server.registry_dir, "cpu", create=False)
    assert budget is not None
    try:
        assert sum(budget.charges()) == 0 and budget.slot_owners() == []
    finally:
        budget.close()


def test_a_killed_engine_is_reclaimed_by_the_next_charge(server: Server) -> None:
    server.complete()
    info = Registry(server.registry_dir).pool(POOL)
    assert info.charged_bytes > 0 and info.pid in server.tree  # the engine core owns the record
    with PoolRecord.create(
        "next", device="cpu", engine="test", model="m", limit_bytes=0, registry_dir=server.registry_dir
    ) as record:
        server.kill_all()  # every process of the engine, front end included: no one cleans up
        assert wait_for(server.all_gone)
        assert (server.registry_dir / f"{POOL}.pool").exists()  # nothing ran in the killed process
        # A budget that the dead engine's charge fills: this charge needs its bytes, and gets them.
        budget = Registry(server.registry_dir).set_budget("cpu", info.charged_bytes)
        assert budget.charged_bytes == info.charged_bytes
        assert record.try_charge(info.charged_bytes)
        # The charge took the dead pool's slot back (its file goes at the next scan).
        budget = Registry(server.registry_dir).device("cpu")  # a scan: the dead record is removed too
        assert budget.charged_bytes == info.charged_bytes and budget.pools == ("next",)
        assert not (server.registry_dir / f"{POOL}.pool").exists()
