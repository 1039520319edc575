"""What the shared-memory registry costs the ledger: try_charge/uncharge, poll, observe, publish.

Run: ``pytest benchmarks/limits --benchmark-only`` (add ``--benchmark-columns=min,median,mean,ops``).

try_charge is on the growth path -- once per logical page mapped, next to driver calls of tens of
microseconds -- never per block; poll runs on every allocation, so it must stay far below a microsecond
or two. "contended" runs while another process charges and releases on the same device as fast as it can.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import elastic_kv
import pytest
from elastic_kv.registry import PoolRecord, Registry
from elastic_kv.registry.layout import SNAPSHOT_INT_FIELDS
from elastic_kv.snapshot import PoolSnapshot, PoolState
from pytest_benchmark.fixture import BenchmarkFixture

MiB = 1 << 20
PAGE = 2 * MiB
WORKER = Path(__file__).resolve().parents[2] / "tests" / "limits" / "pool_worker.py"


def _record(directory: Path, name: str) -> PoolRecord:
    return PoolRecord.create(
        name, device="cuda:0", engine="bench", model="m", limit_bytes=0, registry_dir=directory
    )


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "registry"


@pytest.fixture
def pools(directory: Path) -> Iterator[list[PoolRecord]]:
    """Four pools on one device with a budget: the sum over every slot is part of each charge."""
    Registry(directory).set_budget("cuda:0", 1 << 40)
    records = [_record(directory, f"p{i}") for i in range(4)]
    yield records
    for record in records:
        record.close()


def test_try_charge_and_uncharge_one_page(benchmark: BenchmarkFixture, pools: list[PoolRecord]) -> None:
    record = pools[0]

    def charge_release() -> None:
        assert record.try_charge(PAGE)
        record.uncharge(PAGE)

    benchmark(charge_release)


def test_try_charge_without_budget(benchmark: BenchmarkFixture, directory: Path) -> None:
    record = _record(directory, "solo")

    def charge_release() -> None:
        assert record.try_charge(PAGE)
        record.uncharge(PAGE)

    benchmark(charge_release)
    record.close()


def test_refused_charge_with_four_live_pools(benchmark: BenchmarkFixture, pools: list[PoolRecord]) -> None:
    """The refusal path: the budget is full, so every live owner is checked for death first."""
    Registry(pools[0].path.parent).set_budget("cuda:0", 8 * PAGE)
    for record in pools:
        assert record.try_charge(2 * PAGE)
    benchmark(lambda: pools[0].try_charge(PAGE))
    for record in pools:
        record.uncharge(2 * PAGE)


def test_try_charge_contended(benchmark: BenchmarkFixture, directory: Path, pools: list[PoolRecord]) -> None:
    env = dict(os.environ, ELASTIC_KV_REGISTRY_DIR=str(directory))
    package_root = str(Path(elastic_kv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    other = subprocess.Popen(
        [sys.executable, str(WORKER), "--name", "rival"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdin is not None and other.stdout is not None
    other.stdout.readline()
    other.stdin.write(f"hammer 1 3600 {PAGE}\n")  # runs until killed
    other.stdin.flush()
    time.sleep(0.2)
    record = pools[0]

    def charge_release() -> None:
        assert record.try_charge(PAGE)
        record.uncharge(PAGE)

    try:
        benchmark(charge_release)
    finally:
        other.kill()
        other.wait()
        other.stdin.close()
        other.stdout.close()


def test_poll(benchmark: BenchmarkFixture, pools: list[PoolRecord]) -> None:
    benchmark(pools[0].poll)


def test_observe(benchmark: BenchmarkFixture, pools: list[PoolRecord]) -> None:
    benchmark(pools[0].observe, "map", 4e-5)


def test_publish(benchmark: BenchmarkFixture, pools: list[PoolRecord]) -> None:
    counts = dict.fromkeys(SNAPSHOT_INT_FIELDS, 1)
    snap = PoolSnapshot(name="p0", state=PoolState.ACTIVE, timestamp=time.time(), **counts)
    benchmark(pools[0].publish, snap)


def test_scan_of_four_pools(benchmark: BenchmarkFixture, directory: Path, pools: list[PoolRecord]) -> None:
    """What one kvctl refresh or metrics scrape costs (reclaim pass included)."""
    registry = Registry(directory)
    benchmark(registry.pools)


def test_headroom_when_the_budget_binds(benchmark: BenchmarkFixture, pools: list[PoolRecord]) -> None:
    """headroom_bytes on a device whose budget is the tighter bound: it probes the other owners."""
    Registry(pools[0].path.parent).set_budget("cuda:0", 64 * PAGE)
    benchmark(lambda: pools[0].headroom_bytes)
