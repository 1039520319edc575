"""A pool's physical bytes: what it has charged, the limit it follows, and the headroom outside it.

The ledger charges every byte before the data plane backs it and returns it after the data plane
released it, so that :attr:`PhysicalAccount.charged` always equals the bytes the pool holds (the data
plane's ``mapped_bytes``, plus pages being mapped in the background). Three things bound growth:

* the pool's own **limit** (``ElasticConfig.limit_bytes``, ``KVCacheManager.resize``, or ``kvctl`` through
  the shared record);
* the shared **record** (``elastic_kv.registry.PoolRecord``): ``try_charge`` is atomic across processes
  against the pool limit and the GPU-wide budget, so two engines can never both take the last bytes;
* the **driver's free memory**, less ``min_free_bytes`` left for everything else on the device.

The allocation path must not make system calls or driver calls to *estimate* headroom, so the outside
headroom (record + driver) is read in :meth:`PhysicalAccount.refresh` -- from the ledger's ``maintain()``, at
most every ``free_memory_ttl_s`` -- and corrected by the pool's own charges since. Only real growth (a page
being mapped) pays for ``try_charge``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic_kv.config import ElasticConfig

if TYPE_CHECKING:
    from elastic_kv.registry import PoolRecord, RecordEvents
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
    ) -> None:
        self.limit = config.limit_bytes  # 0 = no limit of the pool's own
        self.charged = 0
        self._cfg = config
        self._record = record
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

    def room(self) -> int:
        """Bytes the pool may still charge: its limit, and the outside headroom last read less what the
        pool charged since. No system call."""
        room = self._outside - (self.charged - self._charged_at_read)
        if self.limit:
            room = min(room, self.limit - self.charged)
        return max(0, room)

    def refresh(self, force: bool = False) -> None:
        """Re-read the outside headroom (record: limit and budget; the driver's free memory) if the last
        reading is older than ``free_memory_ttl_s`` or ``force``."""
        now = self._clock()
        if not force and now - self._read_at < self._cfg.free_memory_ttl_s:
            return
        room = _UNBOUNDED
        if self._record is not None:
            room = min(room, self._record.headroom_bytes)
        if self._physical_free is not None:
            room = min(room, max(0, self._physical_free() - self._cfg.min_free_bytes))
        self._outside = room
        self._charged_at_read = self.charged
        self._read_at = now

    def stale(self) -> None:
        """The outside headroom just proved wrong (the driver or the budget refused): re-read it at the
        next :meth:`refresh`."""
        self._read_at = float("-inf")

    def charge(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` before backing them; False (nothing charged) when the limit, the cached
        headroom or the shared record refuses."""
        if nbytes > self.room():
            return False
        if self._record is not None and not self._record.try_charge(nbytes):
            self.stale()
            return False
        self.charged += nbytes
        return True

    def uncharge(self, nbytes: int) -> None:
        """Return ``nbytes`` the data plane released (or never backed)."""
        if nbytes:
            self.charged -= nbytes
            if self._record is not None:
                self._record.uncharge(nbytes)

    def observe(self, op: str, seconds: float) -> None:
        """A map or unmap latency sample for the record's histograms."""
        if self._record is not None:
            self._record.observe(op, seconds)

    def poll(self) -> RecordEvents | None:
        """What ``kvctl`` changed since the last poll (``None`` without a record)."""
        return self._record.poll() if self._record is not None else None

    def record_limit(self) -> int:
        """The limit ``kvctl`` set in the record (0 = none; 0 without a record)."""
        return self._record.limit_bytes if self._record is not None else 0

    def publish(self, snapshot: Callable[[], PoolSnapshot]) -> None:
        """Publish ``snapshot()`` to the record, at most every ``publish_interval_s``."""
        if self._record is None:
            return
        now = self._clock()
        if now - self._published_at >= self._cfg.publish_interval_s:
            self._published_at = now
            self._record.publish(snapshot())
