"""The registry seen from any process of the user: read every pool and device, change limits, reclaim.

:class:`Registry` is what ``kvctl`` and the Prometheus collector use; it never needs to be the process
that owns a pool. Reading is lock-free (``pread`` of each record, retried while its owner is writing
statistics); changing a limit or a budget takes the device's lock, so it is ordered with every charge.

Reclaiming: every scan (``pools()``, ``devices()``, a new pool's creation) first removes the records of
dead owners and returns their charges to the device budget, under the directory-wide lock. A record file
that no process owns and that is not a record at all (too short, wrong magic) is never deleted: it is
renamed ``<name>.pool.corrupt`` with a warning, for a person to inspect.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_kv.registry.budget import DeviceBudget
from elastic_kv.registry.files import (
    RegistryConfig,
    check_device_name,
    check_pool_name,
    ensure_private_directory,
    file_lock_is_free,
    open_existing,
    owner_is_dead,
    pid_namespace,
    registry_lock,
    remove_stale_temporaries,
)
from elastic_kv.registry.layout import (
    HISTOGRAM_BOUNDS,
    LATENCY_OPS,
    RECORD_NO_LIMIT,
    SNAPSHOT_APPENDED_INT_FIELDS,
    SNAPSHOT_INT_FIELDS,
    UNLIMITED,
    IntField,
    RecordLayout,
)
from elastic_kv.snapshot import PoolSnapshot, PoolState

__all__ = [
    "DeviceInfo",
    "LatencyHistogram",
    "LimitNotFollowedError",
    "PoolInfo",
    "Registry",
    "UnknownDeviceError",
    "UnknownPoolError",
    "read_record",
    "reclaim_dead",
    "reclaim_dead_locked",
]

logger = logging.getLogger(__name__)

_SEQLOCK_RETRIES = 100


class UnknownPoolError(ValueError):
    """No live pool has this name (it never existed, was closed, or its owner died)."""


class LimitNotFollowedError(ValueError):
    """A limit was asked of a pool whose engine cannot follow one (``PoolInfo.follows_limit`` False)."""


class UnknownDeviceError(ValueError):
    """No budget file exists for this device."""


@dataclass(frozen=True, slots=True)
class LatencyHistogram:
    """Latency samples of one operation ("map" or "unmap") of one pool, from ``PoolRecord.observe``."""

    op: str
    bounds: tuple[float, ...]  # bucket upper bounds in seconds; a last bucket +Inf follows
    counts: tuple[int, ...]  # observations per bucket (not cumulative), len(bounds) + 1
    sum_seconds: float

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding quantile ``q`` (``inf`` past the last bound); None if empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        total = self.count
        if total == 0:
            return None
        rank = max(1, math.ceil(q * total))
        seen = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            seen += n
            if seen >= rank:
                return bound
        return math.inf


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """One live pool as its record shows it. ``snapshot`` is None until the owner first publishes."""

    name: str
    device: str
    engine: str
    model: str
    pid: int
    created_at: float
    limit_bytes: int  # UNLIMITED (0) or the limit
    limit_revision: int
    trim_revision: int
    charged_bytes: int  # physical bytes charged against the limit and the device budget
    snapshot: PoolSnapshot | None
    latency: tuple[LatencyHistogram, ...]
    follows_limit: bool = True  # False: the engine cannot act on a limit, so none can be set

    @property
    def reserved_bytes(self) -> int:
        """Physical bytes of backed pages without live blocks (the mapped reserve), from the last snapshot."""
        return 0 if self.snapshot is None else self.snapshot.reserve_pages * self.snapshot.page_bytes

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``kvctl list --json``)."""
        return {
            "name": self.name,
            "device": self.device,
            "engine": self.engine,
            "model": self.model,
            "pid": self.pid,
            "created_at": self.created_at,
            "limit_bytes": self.limit_bytes,
            "follows_limit": self.follows_limit,
            "limit_revision": self.limit_revision,
            "trim_revision": self.trim_revision,
            "charged_bytes": self.charged_bytes,
            "reserved_bytes": self.reserved_bytes,
            "snapshot": None if self.snapshot is None else self.snapshot.as_dict(),
            "latency": {
                h.op: {"bounds": list(h.bounds), "counts": list(h.counts), "sum_seconds": h.sum_seconds}
                for h in self.latency
            },
        }


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One device's budget and what its pools have charged."""

    device: str
    budget_bytes: int  # UNLIMITED (0) or the GPU-wide budget
    budget_revision: int
    total_bytes: int  # device memory as reported by a pool creator; 0 = unknown
    charged_bytes: int  # sum of every pool's charge on the device
    pools: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "budget_revision": self.budget_revision,
            "total_bytes": self.total_bytes,
            "charged_bytes": self.charged_bytes,
            "pools": list(self.pools),
        }


def _decode_stats(name: str, raw: bytes) -> tuple[PoolSnapshot | None, tuple[LatencyHistogram, ...]]:
    snapshot = None
    if RecordLayout.published.get(raw):
        ints = RecordLayout.snapshot_ints.get_all(raw)
        appended = RecordLayout.appended_snapshot_ints.get_all(raw)
        try:
            snapshot = PoolSnapshot(
                name=name,
                state=PoolState(RecordLayout.snapshot_state.get(raw)),
                timestamp=RecordLayout.snapshot_timestamp.get(raw),
                **dict(zip(SNAPSHOT_INT_FIELDS, ints, strict=True)),
                **dict(zip(SNAPSHOT_APPENDED_INT_FIELDS, appended, strict=True)),
            )
        except ValueError:
            state = RecordLayout.snapshot_state.get(raw)
            logger.warning("pool %s published an unknown state %r", name, state)
    latency = tuple(
        LatencyHistogram(
            op=op,
            bounds=HISTOGRAM_BOUNDS,
            counts=RecordLayout.hist_buckets[i].get_all(raw),
            sum_seconds=RecordLayout.hist_sum[i].get(raw),
        )
        for i, op in enumerate(LATENCY_OPS)
    )
    return snapshot, latency


def _read_consistent(fd: int) -> bytes | None:
    """The whole record, its statistics not torn by a concurrent writer; None if not a v1 record."""
    seq_field = RecordLayout.stats_seq
    raw = b""
    for _ in range(_SEQLOCK_RETRIES):
        raw = os.pread(fd, RecordLayout.SIZE, 0)
        if len(raw) < RecordLayout.SIZE:
            return None
        seq = seq_field.get(raw)
        if seq % 2 == 0 and os.pread(fd, 8, seq_field.offset) == raw[seq_field.offset : seq_field.offset + 8]:
            break
    # After many tries (or an owner killed while writing) use the last copy: statistics are advisory.
    if RecordLayout.magic.get(raw) != RecordLayout.MAGIC:
        return None
    if RecordLayout.version.get(raw) != RecordLayout.VERSION:
        return None
    return raw


def read_record(fd: int) -> PoolInfo | None:
    """Decode the record open on ``fd``; None if it is not a record of this layout version."""
    raw = _read_consistent(fd)
    if raw is None:
        return None
    name = RecordLayout.name.get(raw)
    snapshot, latency = _decode_stats(name, raw)
    return PoolInfo(
        name=name,
        device=RecordLayout.device.get(raw),
        engine=RecordLayout.engine.get(raw),
        model=RecordLayout.model.get(raw),
        pid=RecordLayout.pid.get(raw),
        created_at=RecordLayout.created_at.get(raw),
        limit_bytes=RecordLayout.limit_bytes.get(raw),
        limit_revision=RecordLayout.limit_revision.get(raw),
        trim_revision=RecordLayout.trim_revision.get(raw),
        charged_bytes=RecordLayout.charged_bytes.get(raw),
        snapshot=snapshot,
        latency=latency,
        follows_limit=not RecordLayout.flags.get(raw) & RECORD_NO_LIMIT,
    )


def _record_is_dead(fd: int, my_namespace: int) -> bool:
    if file_lock_is_free(fd):
        return True
    raw = os.pread(fd, RecordLayout.SIZE, 0)
    if len(raw) < RecordLayout.SIZE or RecordLayout.magic.get(raw) != RecordLayout.MAGIC:
        return False  # another layout: only its lock can tell, and the lock is held
    return owner_is_dead(
        RecordLayout.pid.get(raw),
        RecordLayout.start_ticks.get(raw),
        RecordLayout.pid_namespace.get(raw),
        my_namespace,
    )


def _release_charge(directory: Path, raw: bytes) -> None:
    """Return a dead record's charge to its device budget (if the record is v1 and holds a slot)."""
    if RecordLayout.version.get(raw) != RecordLayout.VERSION or RecordLayout.slot.get(raw) < 0:
        return
    try:
        budget = DeviceBudget.open(directory, RecordLayout.device.get(raw), create=False)
    except ValueError:
        return
    if budget is None:
        return
    try:
        with budget.locked():
            budget.release_slot_locked(RecordLayout.slot.get(raw), RecordLayout.token.get(raw))
    finally:
        budget.close()


def _move_aside(path: Path) -> None:
    """Rename an unreadable, unowned record to ``<name>.pool.corrupt`` (kept for a person to look at)."""
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt.{n}")
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return
    logger.warning(
        "pool record %s is not a record elastic-kv can read and no process owns it; moved it to %s",
        path,
        target,
    )


def reclaim_dead(config: RegistryConfig) -> list[str]:
    """Remove records whose owners died and return their charges; also free orphaned device slots.

    Returns the names of the reclaimed pools. Safe to run from any process of the user at any time.
    """
    with registry_lock(config):
        return reclaim_dead_locked(config)


def reclaim_dead_locked(config: RegistryConfig) -> list[str]:
    """:func:`reclaim_dead` for a caller that already holds ``registry_lock(config)``."""
    reclaimed: list[str] = []
    directory = config.directory
    namespace = pid_namespace()
    for path in sorted(directory.glob("*.pool")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not _record_is_dead(fd, namespace):
                continue
            raw = os.pread(fd, RecordLayout.SIZE, 0)
            if len(raw) < RecordLayout.SIZE or RecordLayout.magic.get(raw) != RecordLayout.MAGIC:
                _move_aside(path)
                continue
            _release_charge(directory, raw)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            reclaimed.append(path.stem)
            logger.info("reclaimed pool %s: its owner died without closing it", path.stem)
        finally:
            os.close(fd)
    for path in sorted(directory.glob("*.device")):
        try:
            budget = DeviceBudget.open(directory, path.stem, create=False)
        except ValueError:
            continue
        if budget is None:
            continue
        try:
            with budget.locked():
                reclaimed.extend(budget.reclaim_dead_slots_locked())
        finally:
            budget.close()
    remove_stale_temporaries(directory)
    return reclaimed


class Registry:
    """Every pool and device budget in one registry directory, for observers and operators.

    Args:
        directory: the registry directory; ``None`` = ``RegistryConfig.from_env()``. It is created (0700)
            if missing; ``ConfigError`` if it is not a private directory of this user.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self._config = RegistryConfig(directory) if directory is not None else RegistryConfig.from_env()
        ensure_private_directory(self._config.directory)

    @property
    def directory(self) -> Path:
        """The registry directory."""
        return self._config.directory

    def reclaim(self) -> list[str]:
        """Reclaim dead owners' records and charges now (see :func:`reclaim_dead`); their pool names."""
        return reclaim_dead(self._config)

    def pools(self, *, reclaim: bool = True) -> list[PoolInfo]:
        """Every live pool, sorted by name (dead owners' records are reclaimed first unless told not to)."""
        if reclaim:
            self.reclaim()
        out = []
        for path in sorted(self.directory.glob("*.pool")):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                info = read_record(fd)
            finally:
                os.close(fd)
            if info is None:
                logger.warning("skipping %s: not a record of layout version %d", path, RecordLayout.VERSION)
            else:
                out.append(info)
        return out

    def pool(self, name: str) -> PoolInfo:
        """The pool called ``name``: :class:`UnknownPoolError` if none, ``ValueError`` if malformed."""
        check_pool_name(name)
        for info in self.pools():
            if info.name == name:
                return info
        raise self._unknown_pool(name)

    def devices(self, *, reclaim: bool = True) -> list[DeviceInfo]:
        """Every device that has a budget file, sorted by name."""
        if reclaim:
            self.reclaim()
        out = []
        for path in sorted(self.directory.glob("*.device")):
            try:
                budget = DeviceBudget.open(self.directory, path.stem, create=False)
            except ValueError as exc:
                logger.warning("skipping %s: %s", path, exc)
                continue
            if budget is None:
                continue
            try:
                out.append(self._device_info(budget))
            finally:
                budget.close()
        return out

    def device(self, device: str) -> DeviceInfo:
        """The budget of ``device``; :class:`UnknownDeviceError` if no pool or operator ever used it."""
        check_device_name(device)
        for info in self.devices():
            if info.device == device:
                return info
        known = ", ".join(d.device for d in self.devices()) or "none"
        raise UnknownDeviceError(f"no budget for device {device!r} (known devices: {known})")

    def set_limit(self, name: str, limit_bytes: int) -> PoolInfo:
        """Set pool ``name``'s physical limit (``UNLIMITED`` = none) and bump its revision; the new state.

        Ordered with every charge (device lock): a charge that starts after this returns sees the new
        limit. The owner learns of it through ``PoolRecord.poll``. ``ValueError`` if negative,
        :class:`UnknownPoolError` if no such live pool, :class:`LimitNotFollowedError` if the pool's
        engine cannot follow a limit (``PoolInfo.follows_limit``).
        """
        if limit_bytes < 0:
            raise ValueError(f"limit must be >= 0 bytes (0 = unlimited), got {limit_bytes}")
        if limit_bytes != UNLIMITED and not self.pool(name).follows_limit:
            raise LimitNotFollowedError(
                f"pool {name!r} cannot follow a limit: its engine would fail where it cannot get memory "
                "(it still counts against its device's budget; limit the engine's KV cache pool instead)"
            )
        return self._update_record(name, RecordLayout.limit_bytes, limit_bytes, RecordLayout.limit_revision)

    def request_trim(self, name: str) -> PoolInfo:
        """Ask pool ``name`` to return its mapped reserve now (seen as ``trim_requested`` by ``poll``)."""
        return self._update_record(name, None, 0, RecordLayout.trim_revision)

    def set_budget(self, device: str, budget_bytes: int, *, total_bytes: int | None = None) -> DeviceInfo:
        """Set the GPU-wide budget of ``device`` (``UNLIMITED`` = none), creating its file if needed.

        Lowering it below what is charged takes nothing back; pools see ``limit_changed`` and no charge
        succeeds until the sum is under the budget. ``total_bytes`` also records the device's size.
        """
        check_device_name(device)
        if budget_bytes < 0:
            raise ValueError(f"budget must be >= 0 bytes (0 = unlimited), got {budget_bytes}")
        budget = DeviceBudget.open(self.directory, device, create=True)
        assert budget is not None  # create=True never answers None
        try:
            with budget.locked():
                budget.set_budget_locked(budget_bytes)
                if total_bytes is not None:
                    budget.set_total_locked(total_bytes)
            return self._device_info(budget)
        finally:
            budget.close()

    def _device_info(self, budget: DeviceBudget) -> DeviceInfo:
        return DeviceInfo(
            device=budget.device,
            budget_bytes=budget.budget_bytes,
            budget_revision=budget.budget_revision,
            total_bytes=budget.total_bytes,
            charged_bytes=sum(budget.charges()),
            pools=tuple(sorted(name for _, name, _ in budget.slot_owners())),
        )

    def _unknown_pool(self, name: str) -> UnknownPoolError:
        names = ", ".join(p.name for p in self.pools(reclaim=False)) or "none"
        return UnknownPoolError(f"no pool named {name!r} in {self.directory} (pools: {names})")

    def _update_record(self, name: str, field: IntField | None, value: int, revision: IntField) -> PoolInfo:
        check_pool_name(name)
        self.reclaim()  # never act on a dead owner's record
        fd = open_existing(self.directory / f"{name}.pool", RecordLayout.SIZE)
        if fd is None:
            raise self._unknown_pool(name)
        try:
            mapping = mmap.mmap(fd, RecordLayout.SIZE)
            try:
                if (
                    RecordLayout.magic.get(mapping) != RecordLayout.MAGIC
                    or RecordLayout.version.get(mapping) != RecordLayout.VERSION
                ):
                    raise UnknownPoolError(f"pool {name!r} has another record layout version; use its kvctl")
                device = RecordLayout.device.get(mapping)
                budget = DeviceBudget.open(self.directory, device, create=True)
                assert budget is not None
                try:
                    with budget.locked():
                        if field is not None:
                            field.put(mapping, value)
                        revision.put(mapping, revision.get(mapping) + 1)
                finally:
                    budget.close()
            finally:
                mapping.close()
            info = read_record(fd)
        finally:
            os.close(fd)
        assert info is not None
        return info
