"""Shutting down the local transport while calls are in flight (listener side and coordinator side)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from elastic_kv.errors import ConfigError, StateConsistencyError
from elastic_kv.ranks import SocketListener, SocketTransport, new_instance_name, socket_dir, socket_path
from elastic_kv.ranks.messages import NO_EPOCH, Op
from ranks_harness import Cluster, RankNode


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster("socket", 2)
    try:
        yield c
    finally:
        c.close()


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, result


def _restart(cluster: Cluster, r: int) -> None:
    cluster.kill(r)
    cluster.revive()


def test_close_drains_the_in_flight_call_then_removes_the_socket(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    cluster.ctl(0, "script", int(Op.MAP), "stall", 0.6)
    t, result = _in_thread(lambda: c.map([1]))
    cluster.wait_in_flight(0)
    start = time.monotonic()
    drained, file_left = cluster.ctl(0, "close_listener", 5.0)
    assert drained and not file_left
    assert time.monotonic() - start >= 0.1  # it waited for the call
    t.join(5)
    assert result == [None]  # the in-flight call completed and its reply was delivered
    cluster.assert_agree(pool, [1])
    with pytest.raises(StateConsistencyError, match="rank 0 gone"):
        c.map([2])  # the listener is gone for good
    _restart(cluster, 0)


def test_close_that_cannot_drain_keeps_the_socket_for_a_retry(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool, timeout=5.0)
    cluster.ctl(1, "script", int(Op.MAP), "stall", 1.2)
    t, result = _in_thread(lambda: c.map([3]))
    cluster.wait_in_flight(1)
    drained, file_left = cluster.ctl(1, "close_listener", 0.2)
    assert not drained and file_left  # reported, files kept
    with pytest.raises(ConnectionRefusedError):  # but it already stopped accepting
        socket.socket(socket.AF_UNIX).connect(os.fspath(cluster.paths[1]))
    drained, file_left = cluster.ctl(1, "close_listener", 5.0)
    assert drained and not file_left
    t.join(5)
    assert result == [None]
    cluster.assert_agree(pool, [3])
    _restart(cluster, 1)


def test_close_wakes_a_call_blocked_on_the_epoch_fence(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool, timeout=5.0)
    c.map([1])
    epoch = max(cluster.ctl(r, "fence") for r in range(cluster.world)) + 10
    c.unmap([1], epoch=epoch)  # queued on every rank: page 1 is retiring
    cluster.ctl(0, "set_busy_wait", 30.0)
    t, result = _in_thread(lambda: c.map([1]))  # rank 0 waits for the epoch (up to 30 s)
    cluster.wait_in_flight(0)
    start = time.monotonic()
    drained, _ = cluster.ctl(0, "close_listener", 5.0)
    assert drained and time.monotonic() - start < 2.0  # woken, not waited out
    t.join(5)
    assert isinstance(
        result[0], StateConsistencyError
    )  # rank 0 answered BUSY, then was gone for the rollback
    _restart(cluster, 0)


def test_transport_close_wakes_a_pending_broadcast(cluster: Cluster, pool: int) -> None:
    transport = cluster.transport()
    from elastic_kv.ranks import Coordinator

    c = Coordinator(transport, pool=pool, timeout=30.0)
    cluster.ctl(1, "script", int(Op.MAP), "stall", 1.0)
    t, result = _in_thread(lambda: c.map([2]))
    cluster.wait_in_flight(1)
    start = time.monotonic()
    transport.close()
    t.join(5)
    assert time.monotonic() - start < 0.5
    assert isinstance(result[0], StateConsistencyError) and "transport closed" in str(result[0])
    time.sleep(1.0)  # let rank 1 finish the stalled MAP before the next test


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a Unix socket's path must fit 107 bytes, which pytest's own temporary
    directories (``/tmp/pytest-of-USER/pytest-N/popen-gwK/TEST0/...``) exceed once N has three digits."""
    path = Path(tempfile.mkdtemp(prefix="ekv-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_listener_names_and_directory(short_dir: Path) -> None:
    d = socket_dir(short_dir)
    assert d.stat().st_mode & 0o777 == 0o700 and d.name == f"elastic-kv-{os.getuid()}"
    a, b = new_instance_name(), new_instance_name()
    assert a != b and socket_path(a, 0, d) != socket_path(b, 0, d) != socket_path(a, 1, d)
    os.chmod(d, 0o755)
    with pytest.raises(ConfigError, match="must be 0700"):
        socket_dir(short_dir)
    os.chmod(d, 0o700)
    with pytest.raises(ConfigError, match="exceeds"):
        socket_path("x" * 64, 0, short_dir / ("d" * 80))
    with pytest.raises(ValueError, match="instance name"):
        socket_path("../evil", 0, d)


def test_live_listener_is_not_replaced_but_a_stale_file_is(short_dir: Path) -> None:
    d = socket_dir(short_dir)
    path = socket_path(new_instance_name(), 0, d)
    node = RankNode(0)
    node.add_pool(1, 4)
    listener = SocketListener(node.rank, path)
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ConfigError, match="in use"):
        SocketListener(node.rank, path)
    assert listener.close(2.0) and not path.exists()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(os.fspath(path))  # a socket file nobody accepts on, as a killed process leaves it
    stale.close()
    again = SocketListener(node.rank, path)
    from elastic_kv.ranks import Coordinator

    transport = SocketTransport([path])
    c = Coordinator(transport, pool=1)
    c.map([0])
    c.unmap([0], epoch=NO_EPOCH)
    transport.close()
    assert again.close(2.0) and not path.exists()
