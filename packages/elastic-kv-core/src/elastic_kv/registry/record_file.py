"""A pool's record file: made under the first free name, claimed on its device, removed once.

:func:`create_record_file` publishes ``<registry>/<name>.pool`` (under the registry's lock, after reclaiming
what dead owners left, so that a dead owner's record never blocks its name), maps it, and claims the pool's
slot in its device's budget; :class:`OwnedRecord` holds what that made -- descriptor (and with it the
liveness lock), mapping, budget, slot -- and releases it exactly once. What the owner does with the record is
:class:`~elastic_kv.registry.record.PoolRecord`.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic_kv.errors import ConfigError
from elastic_kv.registry.budget import DeviceBudget
from elastic_kv.registry.files import (
    ProcessIdentity,
    RegistryConfig,
    check_pool_name,
    create_file,
    ensure_private_directory,
    registry_lock,
)
from elastic_kv.registry.layout import RecordLayout
from elastic_kv.registry.reading import read_record
from elastic_kv.registry.reclaim import reclaim_dead_locked

__all__ = ["OwnedRecord", "create_record_file"]

logger = logging.getLogger(__name__)

# suffix_if_taken tries name, name-2, ..., name-<_MAX_SUFFIX>.
_MAX_SUFFIX = 999


@dataclass(eq=False)
class OwnedRecord:
    """The resources behind a PoolRecord; released exactly once, by close() or by the finalizer. ``slot``:
    the device budget slot once claimed (-1 before); ``owner_pid``: the process that created it."""

    config: RegistryConfig
    path: Path
    fd: int
    map: mmap.mmap
    budget: DeviceBudget
    token: int
    slot: int = field(default=-1, init=False)
    owner_pid: int = field(default_factory=os.getpid, init=False)

    def release(self) -> None:
        # A forked child inherits the mapping but is not the owner: it must not remove the record.
        if os.getpid() == self.owner_pid:
            try:
                self._remove_shared_state()
            except OSError as exc:  # e.g. the registry directory was deleted: nothing left to clean
                logger.warning("pool record %s: could not remove it cleanly: %s", self.path, exc)
        self.map.close()
        self.budget.close()
        os.close(self.fd)  # drops the liveness lock

    def _remove_shared_state(self) -> None:
        with registry_lock(self.config):
            with self.budget.locked():
                if self.slot >= 0:
                    self.budget.release_slot_locked(self.slot, self.token)
            # Unlink only our own file: after a reclaim (e.g. while this process was stopped) the name
            # may already belong to a new pool.
            try:
                if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass


def create_record_file(
    name: str,
    device: str,
    engine: str,
    model: str,
    limit_bytes: int,
    flags: int,
    registry_dir: Path | None,
    device_total_bytes: int,
    suffix_if_taken: bool,
) -> tuple[str, OwnedRecord]:
    """Create a pool's record file under the first free name, claim its device slot; (name, resources).
    The arguments are :meth:`~elastic_kv.registry.record.PoolRecord.create`'s, checked there."""
    config = RegistryConfig(registry_dir) if registry_dir is not None else RegistryConfig.from_env()
    directory = ensure_private_directory(config.directory)
    owner = ProcessIdentity.current()
    budget = DeviceBudget.open(directory, device, create=True)
    assert budget is not None  # create=True never answers None
    try:
        with registry_lock(config):
            reclaim_dead_locked(config)  # a dead owner's record must not block its name
            chosen, fd, token = _publish_file(
                directory, name, device, engine, model, limit_bytes, owner, suffix_if_taken, flags
            )
            path = directory / f"{chosen}.pool"
            try:
                mapping = mmap.mmap(fd, RecordLayout.SIZE)
            except BaseException:
                os.unlink(path)
                os.close(fd)
                raise
            owned = OwnedRecord(config, path, fd, mapping, budget, token)
            try:
                with budget.locked():
                    owned.slot = budget.claim_slot_locked(token, chosen, owner)
                    if device_total_bytes > 0:
                        budget.set_total_locked(device_total_bytes)
            except BaseException:
                os.unlink(path)
                mapping.close()
                os.close(fd)
                raise
            RecordLayout.slot.put(mapping, owned.slot)
    except BaseException:
        budget.close()
        raise
    return chosen, owned


def _publish_file(
    directory: Path,
    name: str,
    device: str,
    engine: str,
    model: str,
    limit_bytes: int,
    owner: ProcessIdentity,
    suffix_if_taken: bool,
    flags: int,
) -> tuple[str, int, int]:
    """Create the record file under the first free name; (name, locked descriptor, token)."""
    token = secrets.randbits(63) | 1  # never 0: 0 marks a free device slot
    last = _MAX_SUFFIX if suffix_if_taken else 1
    for n in range(1, last + 1):
        candidate = name if n == 1 else f"{name}-{n}"
        if n > 1:
            check_pool_name(candidate)
        content = _initial_record(candidate, device, engine, model, limit_bytes, token, owner, flags)
        fd = create_file(directory, f"{candidate}.pool", content, keep_locked=True)
        if fd is not None:
            return candidate, fd, token
    raise ConfigError(_name_taken_message(directory, name, suffix_if_taken))


def _initial_record(
    name: str,
    device: str,
    engine: str,
    model: str,
    limit_bytes: int,
    token: int,
    owner: ProcessIdentity,
    flags: int,
) -> bytes:
    buf = bytearray(RecordLayout.SIZE)
    RecordLayout.magic.put(buf, RecordLayout.MAGIC)
    RecordLayout.version.put(buf, RecordLayout.VERSION)
    RecordLayout.header_size.put(buf, RecordLayout.SIZE)
    RecordLayout.token.put(buf, token)
    RecordLayout.pid.put(buf, owner.pid)
    RecordLayout.slot.put(buf, -1)
    RecordLayout.start_ticks.put(buf, owner.start_ticks)
    RecordLayout.pid_namespace.put(buf, owner.pid_namespace)
    RecordLayout.created_at.put(buf, time.time())
    RecordLayout.limit_bytes.put(buf, limit_bytes)
    RecordLayout.name.put(buf, name)
    RecordLayout.device.put(buf, device)
    RecordLayout.engine.put(buf, engine)
    RecordLayout.model.put(buf, model)
    RecordLayout.flags.put(buf, flags)
    return bytes(buf)


def _name_taken_message(directory: Path, name: str, suffixed: bool) -> str:
    if suffixed:
        return f"pool names {name}, {name}-2 ... {name}-{_MAX_SUFFIX} are all in use in {directory}"
    owner = ""
    try:
        fd = os.open(directory / f"{name}.pool", os.O_RDONLY | os.O_CLOEXEC)
        try:
            info = read_record(fd)
        finally:
            os.close(fd)
        if info is not None:
            owner = f" by pid {info.pid} ({info.engine}, model {info.model})"
    except OSError:
        pass
    return f"pool name {name!r} is in use{owner}; choose another name for this pool"
