"""What a pool record says, read from any process: :func:`read_record` and the values it returns.

Reading is lock-free: a ``pread`` of the whole record, retried while its owner is writing statistics (the
record's sequence counter is odd or changed during the read), so a reader never blocks an engine.
:class:`PoolInfo` is one pool as read, :class:`DeviceInfo` one device budget, :class:`LatencyHistogram`
one operation's map/unmap latencies.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from elastic_kv.registry.layout import (
    HISTOGRAM_BOUNDS,
    LATENCY_OPS,
    RECORD_NO_LIMIT,
    SNAPSHOT_APPENDED_INT_FIELDS,
    SNAPSHOT_INT_FIELDS,
    RecordLayout,
)
from elastic_kv.snapshot import PoolSnapshot, PoolState

__all__ = ["DeviceInfo", "LatencyHistogram", "PoolInfo", "read_record"]

logger = logging.getLogger(__name__)

_SEQLOCK_RETRIES = 100


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
        """A JSON-ready dict of every field, in field order."""
        return {**asdict(self), "pools": list(self.pools)}


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
