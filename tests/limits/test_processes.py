"""Several real processes on one registry: shared GPU-wide budget, dead owners, limits changed under load."""

from __future__ import annotations

import os
import re
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_kv.registry import DeviceBudget, PoolRecord, Registry
from elastic_kv.registry.files import file_lock_is_free
from elastic_kv.registry.layout import RecordLayout

from limits.helpers import PoolProcess, wait_until

MiB = 1 << 20


def test_two_processes_share_a_gpu_wide_budget(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    registry = Registry(registry_dir)
    registry.set_budget("cuda:0", 64 * MiB)
    a = spawn_pool("engine-a", limit=48 * MiB)
    b = spawn_pool("engine-b", limit=48 * MiB)
    assert a.send(f"charge {40 * MiB}")["ok"]
    assert not b.send(f"charge {32 * MiB}")["ok"]  # 40 + 32 > 64: refused, nothing charged
    assert b.send("state")["charged"] == 0
    assert b.send(f"charge {24 * MiB}")["ok"]
    assert not a.send("charge 1")["ok"]  # the device is full
    assert b.send("poll")["headroom"] == 0
    assert a.send(f"uncharge {16 * MiB}")["ok"]
    assert b.send(f"charge {16 * MiB}")["ok"]
    assert not b.send("charge 1")["ok"]
    assert registry.device("cuda:0").charged_bytes == 64 * MiB
    # A clean exit gives the budget back: B may now grow to its own limit, not past it.
    assert a.send("close")["ok"]
    assert a.finish() == 0
    assert registry.device("cuda:0").charged_bytes == 40 * MiB
    assert b.send(f"charge {8 * MiB}")["ok"]
    assert not b.send("charge 1")["ok"]  # 48 MiB: B's limit
    assert [p.name for p in registry.pools()] == ["engine-b"]


def test_exit_without_close_removes_the_record(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    a = spawn_pool("leaver")
    assert a.send(f"charge {MiB}")["ok"]
    assert a.path.exists()
    a.send("exit")
    assert a.proc.wait(timeout=10) == 0
    assert not a.path.exists()  # removed at interpreter exit, not by a later scan
    budget = DeviceBudget.open(registry_dir, "cuda:0", create=False)
    assert budget is not None
    assert sum(budget.charges()) == 0
    budget.close()


def test_sigkilled_owner_is_reclaimed_by_a_charge_that_needs_its_memory(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    registry = Registry(registry_dir)
    registry.set_budget("cuda:0", 64 * MiB)
    victim = spawn_pool("victim")
    survivor = spawn_pool("survivor")
    assert victim.send(f"charge {48 * MiB}")["ok"]
    assert not survivor.send(f"charge {32 * MiB}")["ok"]
    victim.kill(signal.SIGKILL)
    # No scan ran: the survivor's own charge finds the dead owner and takes its memory.
    assert victim.path.exists()
    assert survivor.send(f"charge {32 * MiB}")["ok"]
    assert registry.device("cuda:0").charged_bytes == 32 * MiB
    # The next scan removes the dead record itself.
    assert [p.name for p in registry.pools()] == ["survivor"]
    assert not victim.path.exists()


def test_sigkilled_owner_is_reclaimed_by_the_next_scan(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    victim = spawn_pool("victim")
    assert victim.send(f"charge {10 * MiB}")["ok"]
    victim.kill(signal.SIGKILL)
    registry = Registry(registry_dir)
    assert registry.reclaim() == ["victim"]
    assert registry.pools() == []
    assert registry.device("cuda:0").charged_bytes == 0
    assert registry.device("cuda:0").pools == ()


def test_next_creator_takes_over_a_dead_owners_name(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    victim = spawn_pool("model-x")
    assert victim.send(f"charge {10 * MiB}")["ok"]
    victim.kill(signal.SIGTERM)  # default action: no atexit, the record stays behind
    assert victim.path.exists()
    with PoolRecord.create(
        "model-x", device="cuda:0", engine="vllm", model="x", limit_bytes=0, registry_dir=registry_dir
    ) as rec:
        assert rec.name == "model-x"  # not model-x-2: the dead owner's name was reclaimed
        assert Registry(registry_dir).device("cuda:0").charged_bytes == 0


def test_dead_owner_is_reclaimed_even_while_a_forked_child_holds_its_lock(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    owner = spawn_pool("forker")
    assert owner.send(f"charge {8 * MiB}")["ok"]
    child = owner.send("fork-sleeper")["child"]
    try:
        owner.kill(signal.SIGKILL)
        fd = os.open(owner.path, os.O_RDONLY)
        try:
            assert not file_lock_is_free(fd)  # the child inherited the owner's lock
        finally:
            os.close(fd)
        registry = Registry(registry_dir)
        assert registry.pools() == []  # the owner's PID is gone: the record is dead all the same
        assert registry.device("cuda:0").charged_bytes == 0
    finally:
        os.kill(child, signal.SIGKILL)


def test_record_of_another_pid_namespace_is_judged_by_its_lock(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    """A container sharing /dev/shm: its PIDs mean nothing here, so only the owner's lock counts."""
    owner = spawn_pool("in-container")
    with open(owner.path, "r+b") as f:  # as written by a process of another PID namespace
        f.seek(RecordLayout.pid.offset)
        f.write((999_999).to_bytes(4, "little"))  # no such PID here
        f.seek(RecordLayout.pid_namespace.offset)
        f.write((12345).to_bytes(8, "little"))
    registry = Registry(registry_dir)
    assert [p.name for p in registry.pools()] == ["in-container"]  # lock held: alive
    owner.kill(signal.SIGKILL)
    assert registry.pools() == []  # lock free: dead


def test_kvctl_limit_while_a_process_charges(
    registry_dir: Path,
    spawn_pool: Callable[..., PoolProcess],
    kvctl: Callable[..., object],
) -> None:
    registry = Registry(registry_dir)
    worker = spawn_pool("grower", limit=64 * MiB)
    assert worker.send(f"follow {MiB}")["ok"]  # grows 1 MiB at a time, polls, shrinks when lowered

    def charged() -> int:
        return registry.pool("grower").charged_bytes

    assert wait_until(lambda: charged() == 64 * MiB)
    done = kvctl("limit", "grower", "16M", "--wait", "10")
    assert done.returncode == 0, done.stderr  # type: ignore[attr-defined]
    # --wait returns once the pool holds no more than the limit, and says how long that took.
    applied = r"applied after \d+\.\d\d s: charged 64.0 MiB -> 16.0 MiB; 0 request\(s\) preempted"
    assert re.search(applied, done.stdout), done.stdout  # type: ignore[attr-defined]
    assert charged() <= 16 * MiB
    samples = []
    for _ in range(50):  # it keeps trying to grow; every charge must respect the new limit
        samples.append(charged())
        time.sleep(0.005)
    assert max(samples) <= 16 * MiB
    done = kvctl("limit", "grower", "32MiB")
    assert done.returncode == 0, done.stderr  # type: ignore[attr-defined]
    assert wait_until(lambda: charged() == 32 * MiB)  # raising a limit grows at once
    report = worker.send("stop")
    assert report["limit_events"] == [16 * MiB, 32 * MiB]
    assert report["violations"] == []
    assert report["charged"] == 32 * MiB


def test_concurrent_charges_never_exceed_the_budget(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    """Property: with four processes charging and releasing at random, the sum never passes the budget."""
    budget_bytes = 40 * MiB
    Registry(registry_dir).set_budget("cuda:0", budget_bytes)
    limits = [0, 0, 16 * MiB, 24 * MiB]
    workers = [spawn_pool(f"w{i}", limit=limit) for i, limit in enumerate(limits)]
    for i, worker in enumerate(workers):
        assert worker.proc.stdin is not None
        worker.proc.stdin.write(f"hammer {i} 1.5 {6 * MiB}\n")
        worker.proc.stdin.flush()
    budget = DeviceBudget.open(registry_dir, "cuda:0", create=False)
    assert budget is not None
    slots = {name: slot for slot, name, _ in budget.slot_owners()}
    deadline = time.monotonic() + 120
    reports = None
    observations = peak = 0
    try:
        while reports is None:
            assert time.monotonic() < deadline, "workers did not finish"
            with budget.locked():  # a consistent view: no charge is half-way
                charges = budget.charges()
            assert sum(charges) <= budget_bytes, charges
            for i, limit in enumerate(limits):
                assert limit == 0 or charges[slots[f"w{i}"]] <= limit
            peak = max(peak, sum(charges))
            observations += 1
            reports = _ready_reports(workers)
            time.sleep(0.0002)
    finally:
        budget.close()
    assert observations >= 20  # the monitor ran while they charged
    assert all("error" not in r for r in reports), reports
    assert sum(r["refused"] for r in reports) > 0  # the budget was actually in the way
    assert peak > budget_bytes // 2
    assert Registry(registry_dir).device("cuda:0").charged_bytes == sum(r["held"] for r in reports)


def _ready_reports(workers: list[PoolProcess]) -> list[dict[str, Any]] | None:
    """Every worker's hammer report if all have answered, else None (never blocks on a busy worker)."""
    streams = [w.proc.stdout for w in workers if w.proc.stdout is not None]
    readable, _, _ = select.select(streams, [], [], 0)
    if len(readable) < len(workers):
        return None
    return [w.read_reply() for w in workers]
