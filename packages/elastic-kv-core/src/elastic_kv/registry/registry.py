"""The registry seen from any process of the user: read every pool and device, change limits, reclaim.

:class:`Registry` is what ``kvctl`` and the Prometheus collector use; it never needs to be the process
that owns a pool. Reading goes through :mod:`.reading` (lock-free); changing a limit or a budget takes the
device's lock, so it is ordered with every charge; every scan first reclaims what dead owners left
(:mod:`.reclaim`).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from elastic_kv.registry.budget import DeviceBudget
from elastic_kv.registry.files import (
    RegistryConfig,
    check_device_name,
    check_pool_name,
    ensure_private_directory,
    open_existing,
)
from elastic_kv.registry.layout import UNLIMITED, IntField, RecordLayout
from elastic_kv.registry.reading import DeviceInfo, PoolInfo, read_record
from elastic_kv.registry.reclaim import reclaim_dead

__all__ = ["LimitNotFollowedError", "Registry", "UnknownDeviceError", "UnknownPoolError"]

logger = logging.getLogger(__name__)


_Info = TypeVar("_Info")


def _read_pool(path: Path) -> PoolInfo | None:
    """The record at ``path``; None (skipped) if it is gone or not of this layout version."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = read_record(fd)
    finally:
        os.close(fd)
    if info is None:
        logger.warning("skipping %s: not a record of layout version %d", path, RecordLayout.VERSION)
    return info


class UnknownPoolError(ValueError):
    """No live pool has this name (it never existed, was closed, or its owner died)."""


class LimitNotFollowedError(ValueError):
    """A limit was asked of a pool whose engine cannot follow one (``PoolInfo.follows_limit`` False)."""


class UnknownDeviceError(ValueError):
    """No budget file exists for this device."""


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

    def _scan(self, suffix: str, read: Callable[[Path], _Info | None], reclaim: bool) -> list[_Info]:
        """What ``read`` makes of each ``*suffix`` file, sorted by name, leaving out the None it returns for a
        file it skips (dead owners' records are reclaimed first unless told not to)."""
        if reclaim:
            self.reclaim()
        found = (read(path) for path in sorted(self.directory.glob(f"*{suffix}")))
        return [info for info in found if info is not None]

    def pools(self, *, reclaim: bool = True) -> list[PoolInfo]:
        """Every live pool, sorted by name (dead owners' records are reclaimed first unless told not to)."""
        return self._scan(".pool", _read_pool, reclaim)

    def pool(self, name: str) -> PoolInfo:
        """The pool called ``name``: :class:`UnknownPoolError` if none, ``ValueError`` if malformed."""
        check_pool_name(name)
        for info in self.pools():
            if info.name == name:
                return info
        raise self._unknown_pool(name)

    def devices(self, *, reclaim: bool = True) -> list[DeviceInfo]:
        """Every device that has a budget file, sorted by name."""
        return self._scan(".device", self._read_device, reclaim)

    def _read_device(self, path: Path) -> DeviceInfo | None:
        try:
            budget = DeviceBudget.open(self.directory, path.stem, create=False)
        except ValueError as exc:
            logger.warning("skipping %s: %s", path, exc)
            return None
        if budget is None:
            return None
        try:
            return self._device_info(budget)
        finally:
            budget.close()

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
