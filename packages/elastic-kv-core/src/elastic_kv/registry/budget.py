"""The GPU-wide budget of one device, shared by every pool on it: :class:`DeviceBudget`.

Each device has one file, ``<registry>/<device>.device`` (layout:
:class:`~elastic_kv.registry.layout.DeviceLayout`): the operator's budget and a table with one charge
per pool (slot). Invariant: while a budget is set, the sum of the charges never grows past it -- a charge
is checked and made under an exclusive ``flock`` on this file, so charges of all processes are
serialised.

Why a file lock and not atomics in shared memory. Python cannot issue a compare-and-swap on a mapping
without a compiled helper, and a lock-free scheme would still need two updates (the device total and the
pool's own share) that a SIGKILL can tear apart. ``flock`` costs two system calls per charge (a few
microseconds, measured in ``benchmarks/limits``), is released by the kernel when its holder dies -- no
robust-mutex recovery, no stuck lock -- and a charge is growth-path work (once per page mapped, next to a
driver call of tens of microseconds), never per block. Keeping every charge in this one file makes each
charge a single 8-byte store under the lock, and the total is their sum: a process killed mid-charge
leaves no drift to repair.

Dead owners. A slot belongs to a pool record (same name and token). When a charge does not fit the
budget, the slots of dead owners are reclaimed first (their records' locks are free, or their PIDs are
gone) and the charge is retried, so a SIGKILLed engine's memory goes back to the others at once.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from pathlib import Path

from elastic_kv.errors import ConfigError, StateConsistencyError
from elastic_kv.registry.files import (
    ProcessIdentity,
    check_device_name,
    create_file,
    file_lock_is_free,
    open_existing,
    owner_is_dead,
    pid_namespace,
)
from elastic_kv.registry.layout import UNLIMITED, DeviceLayout, RecordLayout, SlotLayout

__all__ = ["DeviceBudget", "device_path"]

# How often a live owner's PID is re-read from /proc when a refused charge looks for dead owners. The
# record lock catches every death at once; the PID only adds the case of a dead owner whose forked child
# still holds the inherited lock, which may therefore take up to this long to be noticed.
_PID_RECHECK_S = 1.0


def device_path(directory: Path, device: str) -> Path:
    """The budget file of ``device`` in a registry directory."""
    return directory / f"{check_device_name(device)}.device"


def _initial_content(device: str) -> bytes:
    buf = bytearray(DeviceLayout.SIZE)
    DeviceLayout.magic.put(buf, DeviceLayout.MAGIC)
    DeviceLayout.version.put(buf, DeviceLayout.VERSION)
    DeviceLayout.slot_count.put(buf, DeviceLayout.SLOTS)
    DeviceLayout.budget_bytes.put(buf, UNLIMITED)
    DeviceLayout.device.put(buf, device)
    return bytes(buf)


class _DeviceLock:
    """The device lock as a reusable context manager: thread lock, then ``flock`` (not reentrant).

    A class rather than a ``contextlib`` generator because it sits on the charge path: this saves about
    a microsecond per charge.
    """

    __slots__ = ("_fd", "_threads")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._threads = threading.Lock()

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()


class DeviceBudget:
    """One device's budget file, mapped in this process.

    Every method whose name ends in ``_locked`` must be called inside :meth:`locked`; the others read the
    mapping without the lock (values may be a moment old). One instance may be shared by threads: the
    in-process thread lock complements ``flock``, which does not exclude threads sharing a descriptor.
    """

    def __init__(self, directory: Path, device: str, fd: int, mapping: mmap.mmap) -> None:
        """Use :meth:`open`."""
        self._directory = directory
        self._record_prefix = os.path.join(directory, "")  # str joins: Path costs microseconds per probe
        self._device = device
        self._fd = fd
        self._map = mapping
        self._lock = _DeviceLock(fd)
        self._namespace = pid_namespace()
        self._pid_checked: dict[int, float] = {}  # slot token -> when its owner's PID was last verified

    @classmethod
    def open(cls, directory: Path, device: str, *, create: bool) -> DeviceBudget | None:
        """Map the budget file of ``device``; create it (no budget) if ``create``, else ``None`` if missing.

        ``ValueError`` for a malformed device name, ``ConfigError`` for a file of another user or version.
        """
        path = device_path(directory, device)
        fd = open_existing(path, DeviceLayout.SIZE)
        if fd is None:
            if not create:
                return None
            fd = create_file(directory, path.name, _initial_content(device), keep_locked=False)
            if fd is None:  # another process created it first
                fd = open_existing(path, DeviceLayout.SIZE)
                if fd is None:
                    raise ConfigError(f"budget file {path} appeared and vanished; is something deleting it?")
        try:
            mapping = mmap.mmap(fd, DeviceLayout.SIZE)
        except BaseException:
            os.close(fd)
            raise
        if (
            DeviceLayout.magic.get(mapping) != DeviceLayout.MAGIC
            or DeviceLayout.version.get(mapping) != DeviceLayout.VERSION
        ):
            mapping.close()
            os.close(fd)
            raise ConfigError(
                f"budget file {path} has another format or version; remove it if no pool uses it"
            )
        return cls(directory, device, fd, mapping)

    @property
    def device(self) -> str:
        """The device this budget covers (``cuda:0``, a GPU UUID, ...)."""
        return self._device

    @property
    def budget_bytes(self) -> int:
        """The GPU-wide budget, or ``UNLIMITED`` (0)."""
        return DeviceLayout.budget_bytes.get(self._map)

    @property
    def budget_revision(self) -> int:
        """Incremented by every budget change; pools compare it in ``poll``."""
        return DeviceLayout.budget_revision.get(self._map)

    @property
    def total_bytes(self) -> int:
        """Device memory as a pool creator reported it; 0 = unknown."""
        return DeviceLayout.total_bytes.get(self._map)

    def charges(self) -> tuple[int, ...]:
        """Every slot's charge (0 for free slots), unlocked: a sum over it may mix two instants."""
        return DeviceLayout.charges.get_all(self._map)

    def slot_charge(self, slot: int) -> int:
        """One slot's charge (unlocked read)."""
        return DeviceLayout.charges.get(self._map, slot)

    def slot_owners(self) -> list[tuple[int, str, int]]:
        """``(slot, pool name, pid)`` of every occupied slot (unlocked read)."""
        out = []
        for slot in self._occupied_slots():
            base = DeviceLayout.slots_start + slot * SlotLayout.SIZE
            out.append((slot, SlotLayout.name.get(self._map, base), SlotLayout.pid.get(self._map, base)))
        return out

    def _occupied_slots(self) -> list[int]:
        tokens = DeviceLayout.slot_tokens.unpack_from(self._map, DeviceLayout.slots_start)
        return [slot for slot, token in enumerate(tokens) if token]

    def locked(self) -> _DeviceLock:
        """``with budget.locked():`` excludes every other process (and thread) charging on this device.

        ``flock`` belongs to the open file description, so it is released if this process dies inside
        the block; the thread lock covers threads, which ``flock`` does not tell apart.
        """
        return self._lock

    def set_budget_locked(self, nbytes: int) -> int:
        """Set the budget (``UNLIMITED`` = none) and return the new revision. ``ValueError`` if negative.

        Lowering it below what is charged takes nothing back: no further charge succeeds until enough is
        released. Pools see the change through ``poll`` (``limit_changed``).
        """
        if nbytes < 0:
            raise ValueError(f"budget must be >= 0 bytes (0 = unlimited), got {nbytes}")
        DeviceLayout.budget_bytes.put(self._map, nbytes)
        revision = DeviceLayout.budget_revision.get(self._map) + 1
        DeviceLayout.budget_revision.put(self._map, revision)
        return revision

    def set_total_locked(self, nbytes: int) -> None:
        """Record the device's memory size (used by ``kvctl`` for percentages)."""
        DeviceLayout.total_bytes.put(self._map, max(0, nbytes))

    def claim_slot_locked(self, token: int, name: str, owner: ProcessIdentity) -> int:
        """Take a free slot for pool ``name`` (charge 0) and return its index.

        Reclaims dead owners' slots if none is free; ``ConfigError`` if the device still has no room.
        """
        for attempt in range(2):
            for slot in range(DeviceLayout.SLOTS):
                base = DeviceLayout.slots_start + slot * SlotLayout.SIZE
                if SlotLayout.token.get(self._map, base) == 0:
                    DeviceLayout.charges.put(self._map, slot, 0)
                    SlotLayout.pid.put(self._map, owner.pid, base)
                    SlotLayout.start_ticks.put(self._map, owner.start_ticks, base)
                    SlotLayout.pid_namespace.put(self._map, owner.pid_namespace, base)
                    SlotLayout.name.put(self._map, name, base)
                    SlotLayout.token.put(self._map, token, base)  # last: the slot is taken once this lands
                    return slot
            if attempt == 0:
                self.reclaim_dead_slots_locked()
        raise ConfigError(f"device {self._device} already has {DeviceLayout.SLOTS} pools registered")

    def release_slot_locked(self, slot: int, token: int) -> int:
        """Free ``slot`` if it still belongs to ``token``; return the charge it held (0 if not ours)."""
        base = DeviceLayout.slots_start + slot * SlotLayout.SIZE
        if SlotLayout.token.get(self._map, base) != token:
            return 0
        charged = DeviceLayout.charges.get(self._map, slot)
        DeviceLayout.charges.put(self._map, slot, 0)
        SlotLayout.token.put(self._map, 0, base)
        return charged

    def try_charge_locked(self, slot: int, token: int, nbytes: int, limit_bytes: int) -> int | None:
        """Add ``nbytes`` to ``slot`` if the pool's limit and the device budget allow; the new charge or None.

        ``None`` changes nothing. When only the budget is in the way, dead owners' slots are reclaimed and
        the check is repeated, so a refusal always means "live pools hold the budget".
        :class:`StateConsistencyError` if ``slot`` no longer belongs to ``token``. That look costs a
        few system calls per pool on the device (measured in ``benchmarks/limits``), on the refusal path
        only.
        """
        self._check_owner(slot, token)
        charged = DeviceLayout.charges.get(self._map, slot)
        if limit_bytes != UNLIMITED and charged + nbytes > limit_bytes:
            return None
        budget = DeviceLayout.budget_bytes.get(self._map)
        if budget != UNLIMITED and sum(DeviceLayout.charges.get_all(self._map)) + nbytes > budget:
            if not self.reclaim_dead_slots_locked(alive=slot):
                return None
            if sum(DeviceLayout.charges.get_all(self._map)) + nbytes > budget:
                return None
        DeviceLayout.charges.put(self._map, slot, charged + nbytes)
        return charged + nbytes

    def uncharge_locked(self, slot: int, token: int, nbytes: int) -> int:
        """Take ``nbytes`` off ``slot`` and return the new charge; ``ValueError`` (nothing changed) if more
        than the slot holds, :class:`StateConsistencyError` if ``slot`` no longer belongs to ``token``."""
        self._check_owner(slot, token)
        charged = DeviceLayout.charges.get(self._map, slot)
        if nbytes > charged:
            raise ValueError(f"cannot uncharge {nbytes} bytes: the pool has {charged} bytes charged")
        DeviceLayout.charges.put(self._map, slot, charged - nbytes)
        return charged - nbytes

    def _check_owner(self, slot: int, token: int) -> None:
        # A slot is only taken from a live owner if its record file was deleted by hand and its PID is
        # not visible (another PID namespace). Charging it then would charge whoever holds it now.
        if SlotLayout.token.get(self._map, DeviceLayout.slots_start + slot * SlotLayout.SIZE) != token:
            raise StateConsistencyError(
                f"device {self._device}: slot {slot} no longer belongs to this pool (was its record file "
                "removed by hand?); the pool's charges are no longer accounted"
            )

    def reclaim_dead_slots_locked(self, *, alive: int = -1) -> list[str]:
        """Free every slot whose owner is dead and return those pools' names; their charges go back.

        ``alive``: a slot the caller knows is live (its own), not probed.
        """
        reclaimed = []
        checked: dict[int, float] = {}
        for slot in self._occupied_slots():
            if slot == alive:
                continue
            base = DeviceLayout.slots_start + slot * SlotLayout.SIZE
            token = SlotLayout.token.get(self._map, base)
            if self._slot_owner_alive(base, token):
                checked[token] = self._pid_checked.get(token, 0.0)
            else:
                reclaimed.append(SlotLayout.name.get(self._map, base))
                DeviceLayout.charges.put(self._map, slot, 0)
                SlotLayout.token.put(self._map, 0, base)
        self._pid_checked = checked  # forget owners that are gone
        return reclaimed

    def _slot_owner_alive(self, base: int, token: int) -> bool:
        owner_ns = SlotLayout.pid_namespace.get(self._map, base)
        record = f"{self._record_prefix}{SlotLayout.name.get(self._map, base)}.pool"
        try:
            fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                field = RecordLayout.token
                raw = os.pread(fd, field.codec.size, field.offset)
                if len(raw) == field.codec.size and field.get(raw, -field.offset) == token:
                    if file_lock_is_free(fd):
                        return False  # the owner died: the kernel dropped its lock
                    # The lock is held -- by the owner, or by a child it forked before dying. Only the
                    # PID tells those apart; reading /proc costs more than everything else here, so a
                    # live owner's PID is re-checked at most every _PID_RECHECK_S.
                    now = time.monotonic()
                    if now - self._pid_checked.get(token, 0.0) < _PID_RECHECK_S:
                        return True
                    self._pid_checked[token] = now
                    return not self._pid_dead(base, owner_ns)
            finally:
                os.close(fd)
        # No record carries this slot's token. A creator publishes its record before it claims a slot and
        # a closing owner frees its slot before it removes its record, so this is an owner that died
        # half-way -- or a live owner whose file was deleted by hand, which only its PID can show.
        return owner_ns == self._namespace and owner_ns != 0 and not self._pid_dead(base, owner_ns)

    def _pid_dead(self, base: int, owner_ns: int) -> bool:
        pid = SlotLayout.pid.get(self._map, base)
        return owner_is_dead(pid, SlotLayout.start_ticks.get(self._map, base), owner_ns, self._namespace)

    def close(self) -> None:
        """Unmap and close the file (idempotent). Charges stay: they belong to the pools, not to this view."""
        if self._fd >= 0:
            self._map.close()
            os.close(self._fd)
            self._fd = -1
