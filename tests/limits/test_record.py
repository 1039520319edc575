"""A pool record in one process: life cycle, permissions, names, charging rules, poll, statistics."""

from __future__ import annotations

import gc
import math
import os
import stat
import time
from pathlib import Path

import pytest
from elastic_kv.errors import ConfigError, StateConsistencyError
from elastic_kv.registry import UNBOUNDED, DeviceBudget, PoolRecord, Registry
from elastic_kv.registry.files import ProcessIdentity, RegistryConfig, owner_is_dead, pid_namespace
from elastic_kv.registry.layout import HISTOGRAM_BOUNDS, DeviceLayout, RecordLayout, SlotLayout
from elastic_kv.snapshot import PoolSnapshot, PoolState

MiB = 1 << 20


def make(registry_dir: Path, name: str = "pool-a", *, limit: int = 0, device: str = "cuda:0") -> PoolRecord:
    return PoolRecord.create(
        name, device=device, engine="vllm", model="org/model", limit_bytes=limit, registry_dir=registry_dir
    )


def snapshot(name: str = "pool-a", **overrides: object) -> PoolSnapshot:
    values: dict[str, object] = dict(
        name=name, state=PoolState.SHRINKING, block_size_bytes=65536, page_size=2 * MiB, page_bytes=64 * MiB,
        blocks_per_page=32, total_blocks=4096, used_blocks=1000, free_blocks=3095, available_blocks=2000,
        total_pages=128, mapped_pages=40, reserve_pages=3, pending_pages=2, inflight_pages=1,
        mapped_bytes=40 * 64 * MiB, limit_bytes=3 << 30, reserve_hits=77, reserve_misses=5, epoch=9,
        timestamp=1234.5,
    )  # fmt: skip
    values.update(overrides)
    return PoolSnapshot(**values)  # type: ignore[arg-type]


def test_create_makes_a_private_file_in_a_private_directory(registry_dir: Path) -> None:
    rec = make(registry_dir)
    assert rec.path == registry_dir / "pool-a.pool"
    assert stat.S_IMODE(os.stat(registry_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(rec.path).st_mode) == 0o600
    device_file = registry_dir / "cuda:0.device"
    assert stat.S_IMODE(os.stat(device_file).st_mode) == 0o600
    assert os.stat(rec.path).st_size == RecordLayout.SIZE
    info = Registry(registry_dir).pool("pool-a")
    assert (info.device, info.engine, info.model, info.pid) == ("cuda:0", "vllm", "org/model", os.getpid())
    assert (info.limit_bytes, info.charged_bytes, info.snapshot) == (0, 0, None)
    rec.close()


def test_close_removes_the_record_and_returns_its_charge(registry_dir: Path) -> None:
    registry = Registry(registry_dir)
    registry.set_budget("cuda:0", 100 * MiB)
    with make(registry_dir) as rec:
        assert rec.try_charge(60 * MiB)
        assert registry.device("cuda:0").charged_bytes == 60 * MiB
    assert not rec.path.exists()
    assert registry.pools() == []
    assert registry.device("cuda:0").charged_bytes == 0
    assert registry.device("cuda:0").pools == ()
    rec.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        rec.try_charge(1)
    with pytest.raises(ValueError, match="closed"):
        rec.poll()
    with pytest.raises(ValueError, match="closed"):
        rec.observe("map", 1e-4)


def test_an_unclosed_record_is_removed_when_collected(registry_dir: Path) -> None:
    rec = make(registry_dir)
    path = rec.path
    del rec
    gc.collect()
    assert not path.exists()


def test_names_are_exclusive_and_explicit_names_are_never_suffixed(registry_dir: Path) -> None:
    first = make(registry_dir, "shared")
    with pytest.raises(ConfigError, match=rf"in use by pid {os.getpid()}"):
        make(registry_dir, "shared")
    second = PoolRecord.create(
        "shared", device="cuda:0", engine="sglang", model="m", limit_bytes=0, registry_dir=registry_dir,
        suffix_if_taken=True,
    )  # fmt: skip
    third = PoolRecord.create(
        "shared", device="cuda:1", engine="sglang", model="m", limit_bytes=0, registry_dir=registry_dir,
        suffix_if_taken=True,
    )  # fmt: skip
    assert (second.name, third.name) == ("shared-2", "shared-3")
    first.close()
    again = make(registry_dir, "shared")  # a closed pool's name is free again
    assert again.name == "shared"
    for rec in (second, third, again):
        rec.close()


@pytest.mark.parametrize("name", ["", "-lead", ".hidden", "a/b", "a b", "x" * 65, "naïve", "../up"])
def test_malformed_pool_names_are_refused(registry_dir: Path, name: str) -> None:
    with pytest.raises(ValueError, match="pool name"):
        make(registry_dir, name)


@pytest.mark.parametrize("device", ["", "cuda/0", "cuda 0", "x" * 65])
def test_malformed_device_names_are_refused(registry_dir: Path, device: str) -> None:
    with pytest.raises(ValueError, match="device name"):
        make(registry_dir, device=device)


def test_negative_limit_is_refused(registry_dir: Path) -> None:
    with pytest.raises(ValueError, match="limit"):
        make(registry_dir, limit=-1)
    assert list(registry_dir.glob("*.pool")) == []


def test_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(ConfigError, match="chmod 700"):
        make(loose)


def test_symlinked_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        make(link)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 12345, 12345)
    with pytest.raises(ConfigError, match="belongs to uid 12345"):
        make(foreign)


def test_missing_parent_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        make(tmp_path / "no" / "such")


def test_config_from_env_is_per_user_and_overridable(tmp_path: Path) -> None:
    assert RegistryConfig.from_env({}).directory.name == f"elastic-kv-{os.geteuid()}"
    assert RegistryConfig.from_env({"ELASTIC_KV_REGISTRY_DIR": str(tmp_path)}).directory == tmp_path


def test_charges_respect_the_pool_limit(registry_dir: Path) -> None:
    rec = make(registry_dir, limit=10 * MiB)
    assert rec.try_charge(0)
    assert rec.try_charge(6 * MiB)
    assert not rec.try_charge(5 * MiB)  # would be 11 MiB
    assert rec.charged_bytes == 6 * MiB  # a refused charge takes nothing
    assert rec.try_charge(4 * MiB)
    assert rec.headroom_bytes == 0
    rec.uncharge(10 * MiB)
    assert rec.charged_bytes == 0
    rec.close()


def test_uncharge_errors_change_nothing(registry_dir: Path) -> None:
    rec = make(registry_dir)
    assert rec.try_charge(3 * MiB)
    with pytest.raises(ValueError, match="uncharge"):
        rec.uncharge(4 * MiB)
    with pytest.raises(ValueError, match="negative"):
        rec.uncharge(-1)
    with pytest.raises(ValueError, match="negative"):
        rec.try_charge(-1)
    assert rec.charged_bytes == 3 * MiB
    assert Registry(registry_dir).pool("pool-a").charged_bytes == 3 * MiB
    rec.close()


def test_pools_on_one_device_share_its_budget_and_other_devices_do_not(registry_dir: Path) -> None:
    registry = Registry(registry_dir)
    registry.set_budget("cuda:0", 64 * MiB)
    a, b = make(registry_dir, "a"), make(registry_dir, "b")
    other = make(registry_dir, "c", device="cuda:1")
    assert a.try_charge(40 * MiB)
    assert b.headroom_bytes == 24 * MiB
    assert not b.try_charge(25 * MiB)
    assert b.try_charge(24 * MiB)
    assert not a.try_charge(1)
    assert other.try_charge(1 << 30)  # no budget on cuda:1
    assert other.headroom_bytes == UNBOUNDED
    a.uncharge(8 * MiB)
    assert b.try_charge(8 * MiB)
    assert registry.device("cuda:0").charged_bytes == 64 * MiB
    for rec in (a, b, other):
        rec.close()


def test_poll_reports_each_change_once(registry_dir: Path) -> None:
    registry = Registry(registry_dir)
    rec = make(registry_dir, limit=10 * MiB)
    assert not rec.poll().limit_changed and not rec.poll().trim_requested
    info = registry.set_limit("pool-a", 20 * MiB)
    assert info.limit_bytes == 20 * MiB and info.limit_revision == 1
    events = rec.poll()
    assert events.limit_changed and not events.trim_requested
    assert rec.limit_bytes == 20 * MiB
    assert not rec.poll().limit_changed
    registry.request_trim("pool-a")
    registry.request_trim("pool-a")  # two requests before a poll coalesce into one event
    events = rec.poll()
    assert events.trim_requested and not events.limit_changed
    assert not rec.poll().trim_requested
    registry.set_budget("cuda:0", 1 << 30)  # a budget change is a limit change for every pool on the device
    assert rec.poll().limit_changed
    rec.close()


def test_publish_round_trips_through_the_registry(registry_dir: Path) -> None:
    rec = make(registry_dir)
    snap = snapshot()
    rec.publish(snap)
    info = Registry(registry_dir).pool("pool-a")
    assert info.snapshot == snap
    assert info.reserved_bytes == 3 * 64 * MiB
    rec.publish(snapshot(used_blocks=5, state=PoolState.ACTIVE))  # the last publish wins
    info = Registry(registry_dir).pool("pool-a")
    assert info.snapshot is not None
    assert (info.snapshot.used_blocks, info.snapshot.state) == (5, PoolState.ACTIVE)
    rec.close()


def test_observe_fills_prometheus_style_buckets(registry_dir: Path) -> None:
    rec = make(registry_dir)
    rec.observe("map", HISTOGRAM_BOUNDS[0])  # exactly on a bound: that bucket ("le")
    rec.observe("map", HISTOGRAM_BOUNDS[0] * 1.01)
    rec.observe("map", 0.0)
    rec.observe("unmap", 5.0)  # past the last bound: +Inf
    info = Registry(registry_dir).pool("pool-a")
    hist = {h.op: h for h in info.latency}
    assert hist["map"].counts[:2] == (2, 1) and hist["map"].count == 3
    assert math.isclose(hist["map"].sum_seconds, HISTOGRAM_BOUNDS[0] * 2.01)
    assert hist["unmap"].counts[-1] == 1 and hist["unmap"].count == 1
    for op, seconds in (("remap", 1e-4), ("map", -1.0), ("map", float("nan"))):
        with pytest.raises(ValueError):
            rec.observe(op, seconds)
    rec.close()


def test_forked_child_closing_an_inherited_record_leaves_it_alone(registry_dir: Path) -> None:
    rec = make(registry_dir)
    assert rec.try_charge(MiB)
    pid = os.fork()
    if pid == 0:  # the child: close its copy, then leave without running the parent's finalizers
        try:
            rec.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rec.path.exists()
    assert Registry(registry_dir).pool("pool-a").charged_bytes == MiB
    rec.close()


def test_owner_is_dead_defeats_pid_reuse() -> None:
    me = ProcessIdentity.current()
    ns = pid_namespace()
    assert not owner_is_dead(me.pid, me.start_ticks, me.pid_namespace, ns)
    assert owner_is_dead(me.pid, me.start_ticks + 1, me.pid_namespace, ns)  # same PID, another process
    assert not owner_is_dead(
        me.pid, me.start_ticks + 1, me.pid_namespace + 1, ns
    )  # foreign namespace: unknown


def test_foreign_layout_versions_are_skipped_not_misread(registry_dir: Path) -> None:
    rec = make(registry_dir)
    with open(rec.path, "r+b") as f:  # pretend a newer release wrote this record
        f.seek(RecordLayout.version.offset)
        f.write((RecordLayout.VERSION + 1).to_bytes(2, "little"))
    registry = Registry(registry_dir)
    assert registry.pools() == []
    assert rec.path.exists()  # its owner holds the lock: never reclaimed
    rec.close()


def test_stale_temporary_files_are_removed(registry_dir: Path) -> None:
    registry = Registry(registry_dir)
    stale = registry_dir / ".x.pool.0123.tmp"
    fresh = registry_dir / ".y.pool.4567.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 60
    os.utime(stale, (old, old))
    registry.reclaim()
    assert not stale.exists()
    assert fresh.exists()  # could be a creator that has not locked it yet


def test_close_survives_a_deleted_registry_directory(
    registry_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec = make(registry_dir)
    assert rec.try_charge(MiB)
    for path in registry_dir.iterdir():
        path.unlink()
    registry_dir.rmdir()
    rec.close()  # nothing shared is left to clean; local resources are still released
    assert "could not remove it cleanly" in caplog.text


def test_a_pool_whose_slot_was_taken_refuses_to_charge_someone_elses(registry_dir: Path) -> None:
    """Only possible when its record file is deleted by hand and its PID is not visible (a container)."""
    rec = make(registry_dir)
    assert rec.try_charge(MiB)
    budget = DeviceBudget.open(registry_dir, "cuda:0", create=False)
    assert budget is not None
    [(slot, name, _)] = budget.slot_owners()
    budget.close()
    assert name == "pool-a"
    with open(registry_dir / "cuda:0.device", "r+b") as f:  # what reclaiming the slot as dead does
        f.seek(DeviceLayout.slots_start + slot * SlotLayout.SIZE + SlotLayout.token.offset)
        f.write(bytes(8))
    with pytest.raises(StateConsistencyError, match="no longer belongs"):
        rec.try_charge(MiB)
    with pytest.raises(StateConsistencyError):
        rec.uncharge(MiB)
    rec.close()
