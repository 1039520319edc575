"""One pool's record in the shared-memory registry, as its owner sees it: :class:`PoolRecord`.

The ledger of each pool creates one record. Through it the pool

* charges the physical bytes it backs against its own limit *and* its device's GPU-wide budget
  (:meth:`PoolRecord.try_charge` / :meth:`PoolRecord.uncharge`), atomically across processes;
* learns, without a system call, that ``kvctl`` changed its limit or the device budget, or asked for a
  trim (:meth:`PoolRecord.poll`);
* publishes its statistics and map/unmap latencies for ``kvctl`` and the Prometheus collector, which may
  run in any other process of the user (:meth:`PoolRecord.publish`, :meth:`PoolRecord.observe`).

Life cycle: the record is a file ``<registry>/<name>.pool`` (0600, layout
:class:`~elastic_kv.registry.layout.RecordLayout`) mapped in the owner, who holds an exclusive ``flock``
on it until it closes. :meth:`PoolRecord.close` (also run at interpreter exit and when the record is
garbage-collected) returns the pool's charge to the device and removes the file. If the owner dies without
closing -- SIGKILL, OOM killer -- the next scan (``kvctl``, a metrics scrape, the next pool created) or a
charge that needs the memory reclaims it.

A pool whose ranks back every page on several devices has one record per device
(:mod:`elastic_kv.registry.shares`).

Names are the pool's own, exactly as given: two pools cannot share one (the second gets ``ConfigError``
while the first lives) unless the creator asks for a free suffix (``suffix_if_taken``), which is meant for
names the engine plugin made up, never for a name the user chose.
"""

from __future__ import annotations

import bisect
import logging
import struct
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from elastic_kv.registry.files import (
    check_device_name,
    check_pool_name,
)
from elastic_kv.registry.layout import (
    HISTOGRAM_BOUNDS,
    LATENCY_OPS,
    RECORD_NO_LIMIT,
    SNAPSHOT_APPENDED_INT_FIELDS,
    SNAPSHOT_INT_FIELDS,
    UNLIMITED,
    RecordLayout,
)
from elastic_kv.registry.record_file import OwnedRecord, create_record_file
from elastic_kv.snapshot import PoolSnapshot

__all__ = ["UNBOUNDED", "UNLIMITED", "PoolRecord", "RecordEvents"]

logger = logging.getLogger(__name__)

# headroom_bytes when neither a pool limit nor a device budget applies.
UNBOUNDED = sys.maxsize


@dataclass(frozen=True, slots=True)
class RecordEvents:
    """What changed since the previous :meth:`PoolRecord.poll` (events coalesce: several changes = one)."""

    limit_changed: bool  # the pool limit or the device budget changed: re-read limit_bytes / headroom_bytes
    trim_requested: bool  # kvctl asked the pool to return its mapped reserve now


_NO_EVENTS = RecordEvents(limit_changed=False, trim_requested=False)
_REVISIONS = struct.Struct("<QQ")  # RecordLayout.limit_revision, then trim_revision


class PoolRecord:
    """One pool's shared-memory record, owned by the process that created it (see the module docstring).

    Thread-safe. Use :meth:`create`; call :meth:`close` on clean shutdown (or use it as a context manager).
    Methods other than :meth:`close` raise ``ValueError`` after it.
    """

    def __init__(self, owned: OwnedRecord, name: str, device: str, engine: str, model: str) -> None:
        """Use :meth:`create`."""
        self._owned = owned
        self._map = owned.map
        self._budget = owned.budget
        self._name = name
        self._device = device
        self._engine = engine
        self._model = model
        self._charge_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._seen_revisions: tuple[int, int] = _REVISIONS.unpack_from(
            self._map, RecordLayout.limit_revision.offset
        )
        self._seen_budget = self._budget.budget_revision
        self._finalizer = weakref.finalize(self, owned.release)

    @classmethod
    def create(
        cls,
        name: str,
        *,
        device: str,
        engine: str,
        model: str,
        limit_bytes: int,
        registry_dir: Path | None = None,
        device_total_bytes: int = 0,
        suffix_if_taken: bool = False,
        follows_limit: bool = True,
    ) -> PoolRecord:
        """Register a new pool and return its record, owned by this process.

        Args:
            name: the pool's name, unique in the registry (1-64 of ``A-Z a-z 0-9 . _ -``).
            device: the device the pool's memory lives on; every pool naming the same device shares its
                budget. Use one spelling per physical GPU on the host (e.g. the GPU UUID when processes
                see different ``CUDA_VISIBLE_DEVICES``).
            engine, model: shown by ``kvctl`` and in metric labels (a long model path keeps its tail).
            limit_bytes: the pool's initial physical limit; ``UNLIMITED`` (0) = none.
            registry_dir: the registry directory; ``None`` = ``RegistryConfig.from_env()``.
            device_total_bytes: the device's memory size, if known (``kvctl`` uses it for percentages).
            suffix_if_taken: if ``name`` belongs to a live pool, use ``name-2``, ``name-3``, ... instead of
                failing. For names the plugin derives itself; an explicit user name must stay exact.
            follows_limit: False for a pool whose engine cannot act on a limit (it would fail instead):
                ``Registry.set_limit`` and ``kvctl limit`` refuse to set one. The device budget still applies.

        Raises:
            ValueError: malformed name or device, negative limit.
            ConfigError: the name belongs to a live pool (and no suffix was asked for), the registry
                directory is not private to this user, or the device has no free slot.
        """
        check_pool_name(name)
        check_device_name(device)
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0 (0 = unlimited), got {limit_bytes}")
        if limit_bytes and not follows_limit:
            raise ValueError(f"pool {name!r} follows no limit, got limit_bytes={limit_bytes}")
        flags = 0 if follows_limit else RECORD_NO_LIMIT
        chosen, owned = create_record_file(
            name, device, engine, model, limit_bytes, flags, registry_dir, device_total_bytes, suffix_if_taken
        )
        return cls(owned, chosen, device, engine, model)

    # -- properties (lock-free reads of the mapping) -----------------------------------------------------

    @property
    def name(self) -> str:
        """The pool's registry name (``name`` as given, or with the suffix ``create`` chose)."""
        return self._name

    @property
    def device(self) -> str:
        """The device whose budget the pool charges."""
        return self._device

    @property
    def path(self) -> Path:
        """The record file."""
        return self._owned.path

    @property
    def limit_bytes(self) -> int:
        """The pool's current physical limit, ``UNLIMITED`` (0) for none. ``kvctl`` may change it any time."""
        return RecordLayout.limit_bytes.get(self._map)

    @property
    def budget_bytes(self) -> int:
        """The GPU-wide budget of the pool's device, ``UNLIMITED`` (0) for none. ``kvctl`` may change it any
        time."""
        return self._budget.budget_bytes

    @property
    def charged_bytes(self) -> int:
        """Physical bytes this pool has charged."""
        return self._budget.slot_charge(self._owned.slot)

    @property
    def headroom_bytes(self) -> int:
        """How many more bytes a charge could get now, within the limit and the budget (``UNBOUNDED`` if
        neither applies). A hint read without the lock: another pool may take the budget first.

        A ledger that trusts this number may never call :meth:`try_charge` while the budget looks full,
        so the charge of an owner that died would block it until some scan reclaimed it. Therefore, when
        the device budget is the tighter bound, dead owners are looked for first: about 9 us per other
        pool on the device here (a record-lock probe; a live owner's PID is re-read at most once a second).
        Call it once per engine step, not per allocation.
        """
        room, budget_bound = self._room()
        if budget_bound:
            with self._budget.locked():
                reclaimed = self._budget.reclaim_dead_slots_locked(alive=self._owned.slot)
            if reclaimed:
                room, _ = self._room()
        return max(0, room)

    def _room(self) -> tuple[int, bool]:
        """(room under the limit and the budget, whether the budget is the tighter bound)."""
        charged = self._budget.slot_charge(self._owned.slot)
        limit = RecordLayout.limit_bytes.get(self._map)
        room = UNBOUNDED if limit == UNLIMITED else limit - charged
        budget = self._budget.budget_bytes
        if budget != UNLIMITED:
            budget_room = budget - sum(self._budget.charges())
            if budget_room < room:
                return budget_room, True
        return room, False

    # -- charging -------------------------------------------------------------------------------------

    def try_charge(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` physical bytes within the pool limit and the device's GPU-wide budget.

        Atomic across processes: it succeeds only if, at one instant under the device lock, this pool's
        charge plus ``nbytes`` fits its limit and every pool's charge on the device plus ``nbytes`` fits
        the budget. False charges nothing -- the caller reports ``PoolExhausted`` pressure. Costs two
        ``flock`` calls (microseconds; see ``benchmarks/limits``): call it per page mapped, not per block.
        ``ValueError`` if ``nbytes`` is negative or the record is closed; ``StateConsistencyError`` if
        the pool lost its device slot (its record file was deleted by hand and its PID is not visible).
        """
        if nbytes < 0:
            raise ValueError(f"cannot charge a negative amount ({nbytes} bytes)")
        with self._charge_lock:
            self._check_open()
            if nbytes == 0:
                return True
            with self._budget.locked():
                charged = self._budget.try_charge_locked(
                    self._owned.slot, self._owned.token, nbytes, RecordLayout.limit_bytes.get(self._map)
                )
                if charged is None:
                    return False
                RecordLayout.charged_bytes.put(self._map, charged)
        return True

    def uncharge(self, nbytes: int) -> None:
        """Return ``nbytes`` previously charged. ``ValueError`` (nothing changed) if negative, more than
        the pool has charged, or the record is closed."""
        if nbytes < 0:
            raise ValueError(f"cannot uncharge a negative amount ({nbytes} bytes)")
        with self._charge_lock:
            self._check_open()
            with self._budget.locked():
                charged = self._budget.uncharge_locked(self._owned.slot, self._owned.token, nbytes)
                RecordLayout.charged_bytes.put(self._map, charged)

    # -- control from kvctl ---------------------------------------------------------------------------

    def poll(self) -> RecordEvents:
        """What ``kvctl`` changed since the last poll: the limit or the device budget, or a trim request.

        Reads three counters from the mappings -- no system call, no lock -- so the ledger may call it on
        every allocation. A change seen once is not reported again.
        """
        if self._closed:
            raise ValueError(f"pool record {self._name!r} is closed")
        # limit_revision and trim_revision are adjacent: one unpack reads both.
        revisions = _REVISIONS.unpack_from(self._map, RecordLayout.limit_revision.offset)
        budget_rev = self._budget.budget_revision
        if revisions == self._seen_revisions and budget_rev == self._seen_budget:
            return _NO_EVENTS  # the common case, kept allocation-free
        events = RecordEvents(
            limit_changed=revisions[0] != self._seen_revisions[0] or budget_rev != self._seen_budget,
            trim_requested=revisions[1] != self._seen_revisions[1],
        )
        self._seen_revisions, self._seen_budget = revisions, budget_rev
        return events

    def control_revision(self) -> tuple[int, int, int]:
        """(limit, trim, device budget) revisions now, without consuming them as :meth:`poll` does: a
        thread other than the pool's owner may watch them to wake an idle engine (no lock, no syscall)."""
        limit, trim = _REVISIONS.unpack_from(self._map, RecordLayout.limit_revision.offset)
        return limit, trim, self._budget.budget_revision

    # -- statistics -----------------------------------------------------------------------------------

    def publish(self, snapshot: PoolSnapshot) -> None:
        """Store ``snapshot`` in the record for ``kvctl`` and the metrics collector (the last one wins).

        The pool's name in the registry is the record's; ``snapshot.name`` is not stored.
        """
        ints = [int(getattr(snapshot, field)) for field in SNAPSHOT_INT_FIELDS]
        appended = [int(getattr(snapshot, field)) for field in SNAPSHOT_APPENDED_INT_FIELDS]
        with self._stats_lock:
            self._check_open()
            m = self._map
            self._begin_stats_write()
            RecordLayout.snapshot_state.put(m, snapshot.state.value)
            RecordLayout.snapshot_timestamp.put(m, snapshot.timestamp)
            for index, value in enumerate(ints):
                RecordLayout.snapshot_ints.put(m, index, value)
            for index, value in enumerate(appended):
                RecordLayout.appended_snapshot_ints.put(m, index, value)
            RecordLayout.published.put(m, RecordLayout.published.get(m) + 1)
            self._end_stats_write()

    def observe(self, op: str, seconds: float) -> None:
        """Add one latency sample of ``op`` ("map" or "unmap") to the record's histogram.

        ``ValueError`` for another op or a negative duration. A few stores into the mapping, no syscall.
        """
        try:
            index = LATENCY_OPS.index(op)
        except ValueError:
            raise ValueError(f"unknown latency op {op!r}; expected one of {LATENCY_OPS}") from None
        if not seconds >= 0.0:  # also rejects NaN
            raise ValueError(f"latency must be a non-negative number of seconds, got {seconds}")
        bucket = bisect.bisect_left(HISTOGRAM_BOUNDS, seconds)  # first bound >= seconds: Prometheus' "le"
        with self._stats_lock:
            self._check_open()
            m = self._map
            self._begin_stats_write()
            RecordLayout.hist_count[index].put(m, RecordLayout.hist_count[index].get(m) + 1)
            RecordLayout.hist_sum[index].put(m, RecordLayout.hist_sum[index].get(m) + seconds)
            buckets = RecordLayout.hist_buckets[index]
            buckets.put(m, bucket, buckets.get(m, bucket) + 1)
            self._end_stats_write()

    def _begin_stats_write(self) -> None:
        # Sequence lock: odd while writing, so a reader in another process retries instead of keeping a
        # torn copy. Only the owner writes statistics, under _stats_lock.
        RecordLayout.stats_seq.put(self._map, RecordLayout.stats_seq.get(self._map) + 1)

    def _end_stats_write(self) -> None:
        RecordLayout.stats_seq.put(self._map, RecordLayout.stats_seq.get(self._map) + 1)

    # -- life cycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Return the pool's charge to the device budget and remove the record. Idempotent.

        Also runs at interpreter exit and if the record is garbage-collected unclosed.
        """
        with self._charge_lock, self._stats_lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> PoolRecord:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"limit={self.limit_bytes} charged={self.charged_bytes}"
        return f"PoolRecord({self._name!r}, device={self._device!r}, engine={self._engine!r}, {state})"

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"pool record {self._name!r} is closed")
