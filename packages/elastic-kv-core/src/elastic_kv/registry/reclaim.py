"""Reclaiming what dead owners left: :func:`reclaim_dead`.

Every scan (``Registry.pools()``, ``Registry.devices()``, a new pool's creation) first removes the records
of dead owners and returns their charges to the device budget, under the directory-wide lock. A record file
that no process owns and that is not a record at all (too short, wrong magic) is never deleted: it is
renamed ``<name>.pool.corrupt`` with a warning, for a person to inspect.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from elastic_kv.registry.budget import DeviceBudget
from elastic_kv.registry.files import (
    RegistryConfig,
    file_lock_is_free,
    owner_is_dead,
    pid_namespace,
    registry_lock,
    remove_stale_temporaries,
)
from elastic_kv.registry.layout import RecordLayout

__all__ = ["reclaim_dead", "reclaim_dead_locked"]

logger = logging.getLogger(__name__)


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
