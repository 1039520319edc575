"""A pool's physical bytes: what it has charged, the limit it follows, and the headroom outside it.

The ledger charges every byte before the data plane backs it and returns it after the data plane
released it, so that :attr:`PhysicalAccount.charged` always equals the bytes the pool holds (the data
plane's ``mapped_bytes``, plus pages being mapped in the background). Three things bound growth:

* the pool's own **limit** (``ElasticConfig.limit_bytes``, ``Ledger.resize``, or ``kvctl`` through
  the shared record);
* the shared **record** (``elastic_kv.registry.PoolRecord``): ``try_charge`` is atomic across processes
  against the pool limit and the GPU-wide budget, so two engines can never both take the last bytes;
  a pool whose ranks back every page on several devices (tensor parallelism) has one record per device
  (:class:`~elastic_kv.registry.DeviceShare`), each charged for the ranks on its device;
* the **driver's free memory**, less ``min_free_bytes`` left for everything else on the device.

The allocation path must not make system calls or driver calls to *estimate* headroom, so the outside
headroom (record + driver) is read in :meth:`PhysicalAccount.refresh` -- from the ledger's ``maintain()``, at
most every ``free_memory_ttl_s`` -- and corrected by the pool's own charges since. Only real growth (a page
being mapped) pays for ``try_charge``.

Units. The ledger counts the bytes of one rank (``BlockGeometry.page_bytes`` per page): ``charged``,
``limit`` and ``room()`` are in those units. A share charges its record ``ranks`` times as much -- the bytes
those ranks really back on that device -- and its record's limit and headroom are divided by ``ranks``.
Shares are charged in order; if one refuses, those charged before it are returned, so no device ever
holds a charge past its budget, even for a moment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from elastic_kv.config import ElasticConfig

if TYPE_CHECKING:
    from elastic_kv.registry import DeviceShare, PoolRecord, RecordEvents
    from elastic_kv.snapshot import PoolSnapshot

__all__ = ["PhysicalAccount"]

_UNBOUNDED = 1 << 62


class PhysicalAccount:
    """Charges, limit and cached headroom of one pool (see the module docstring). Driven by the ledger on
    its owner thread; ``room()`` and the attributes may be read from any thread."""

    def __init__(
        self,
        config: ElasticConfig,
        record: PoolRecord | None,
        physical_free: Callable[[], int] | None,
        clock: Callable[[], float],
        shares: Sequence[DeviceShare] = (),
    ) -> None:
        """``shares``: the pool's records with the number of ranks on each device (the first is the
        primary record); without them, ``record`` alone with one rank."""
        self.charged = 0
        self._cfg = config
        if not shares and record is not None:
            from elastic_kv.registry import DeviceShare

            shares = (DeviceShare(record, 1),)
        self._shares = tuple(shares)
        self._record = self._shares[0].record if self._shares else None
        self.limit = self.record_limit() if self._shares else config.limit_bytes  # 0 = no limit
        self._physical_free = physical_free
        self._clock = clock
        self._outside = _UNBOUNDED  # headroom outside the pool when last read ...
        self._charged_at_read = 0  # ... and what the pool had charged then
        self._read_at = float("-inf")
        self._published_at = float("-inf")

    @property
    def record(self) -> PoolRecord | None:
        """The shared record, if any."""
        return self._record

    def over_limit(self) -> bool:
        """The pool holds more than its limit (it is shrinking)."""
        return bool(self.limit) and self.charged > self.limit

    def ceiling(self, fresh: bool = False) -> int:
        """The most bytes (one rank's) the pool may ever hold while its limit and its devices' budgets stay
        as they are: the tightest of them, 0 when none is set. Other pools' charges and the driver's free
        memory are left out: they change on their own. Reads the records' mappings (no lock, no syscall);
        ``fresh``: the limit as the records say now, rather than the one the pool follows (applied by
        ``maintain``)."""
        limit = self.record_limit() if fresh and self._shares else self.limit
        bounds = [limit] if limit else []
        bounds += [s.record.budget_bytes // s.ranks for s in self._shares if s.record.budget_bytes]
        return max(1, min(bounds)) if bounds else 0

    def room(self, fresh: bool = False) -> int:
        """Bytes the pool may still charge: its limit, and the outside headroom last read less what the
        pool charged since (no system call), or, ``fresh``, the headroom read now (:meth:`outside_room`)."""
        room = self.outside_room() if fresh else self._outside - (self.charged - self._charged_at_read)
        if self.limit:
            room = min(room, self.limit - self.charged)
        return max(0, room)

    def refresh(self, force: bool = False) -> None:
        """Re-read the outside headroom (record: limit and budget; the driver's free memory) if the last
        reading is older than ``free_memory_ttl_s`` or ``force``."""
        now = self._clock()
        if not force and now - self._read_at < self._cfg.free_memory_ttl_s:
            return
        self._outside = self.outside_room()
        self._charged_at_read = self.charged
        self._read_at = now

    def outside_room(self) -> int:
        """Bytes (one rank's) the records -- limit and budget -- and the driver's free memory would let the
        pool charge now, read afresh (a system call per record where the budget binds, see
        ``PoolRecord.headroom_bytes``, and the driver's). Any thread."""
        room = _UNBOUNDED
        for share in self._shares:
            room = min(room, share.record.headroom_bytes // share.ranks)
        if self._physical_free is not None:
            room = min(room, max(0, self._physical_free() - self._cfg.min_free_bytes))
        return room

    def stale(self) -> None:
        """The outside headroom just proved wrong (the driver or the budget refused): re-read it at the
        next :meth:`refresh`."""
        self._read_at = float("-inf")

    def charge(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` before backing them; False (nothing charged) when the limit, the cached
        headroom or the shared record refuses."""
        if nbytes > self.room():
            return False
        for n, share in enumerate(self._shares):
            if not share.record.try_charge(nbytes * share.ranks):
                for done in self._shares[:n]:
                    done.record.uncharge(nbytes * done.ranks)
                self.stale()
                return False
        self.charged += nbytes
        return True

    def uncharge(self, nbytes: int) -> None:
        """Return ``nbytes`` the data plane released (or never backed)."""
        if nbytes:
            self.charged -= nbytes
            for share in self._shares:
                share.record.uncharge(nbytes * share.ranks)

    def observe(self, op: str, seconds: float) -> None:
        """A map or unmap latency sample for the record's histograms."""
        if self._record is not None:
            self._record.observe(op, seconds)

    def poll(self) -> RecordEvents | None:
        """What ``kvctl`` changed since the last poll, in any of the pool's records (``None`` without a
        record, or when nothing changed in a pool with several)."""
        if len(self._shares) == 1:
            return self._shares[0].record.poll()
        if not self._shares:
            return None
        from elastic_kv.registry import RecordEvents

        events = [share.record.poll() for share in self._shares]
        limit = any(e.limit_changed for e in events)
        trim = any(e.trim_requested for e in events)
        return RecordEvents(limit_changed=limit, trim_requested=trim) if limit or trim else None

    def record_limit(self) -> int:
        """The tightest limit ``kvctl`` set in the pool's records, per rank (0 = none, or no record)."""
        limits = [s.record.limit_bytes // s.ranks for s in self._shares if s.record.limit_bytes]
        # A limit below one rank's share rounds to 0 bytes, which would read as "no limit": keep 1 byte.
        return max(1, min(limits)) if limits else 0

    def publish(self, snapshot: Callable[[], PoolSnapshot]) -> None:
        """Publish ``snapshot()`` to the record, at most every ``publish_interval_s``."""
        if not self._shares:
            return
        now = self._clock()
        if now - self._published_at >= self._cfg.publish_interval_s:
            self._published_at = now
            self.publish_now(snapshot())

    def publish_now(self, snap: PoolSnapshot) -> None:
        """Publish ``snap`` to every record now, its byte counts scaled to the ranks on that device."""
        for share in self._shares:
            if share.ranks == 1:
                share.record.publish(snap)
            else:
                share.record.publish(
                    dataclasses.replace(
                        snap,
                        mapped_bytes=snap.mapped_bytes * share.ranks,
                        limit_bytes=share.record.limit_bytes,
                        largest_request_bytes=snap.largest_request_bytes * share.ranks,
                    )
                )

    @property
    def shares(self) -> tuple[DeviceShare, ...]:
        """The pool's records and the ranks each stands for (empty without a record)."""
        return self._shares
