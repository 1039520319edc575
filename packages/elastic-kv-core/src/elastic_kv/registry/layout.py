"""Binary layouts of the shared-memory registry files: one pool record, one device budget.

Both files are fixed-size, little-endian and versioned (``magic`` + ``version`` at offset 0). They are read
and written through :mod:`mmap` mappings with precompiled :class:`struct.Struct`
codecs, never pickle: any process of the user -- another engine, ``kvctl``, a metrics exporter built
against another release -- can read them, and a reader that finds a version it does not know skips the
file instead of misreading it.

What never changes between versions (so that any release can reclaim any other release's stale files):
the file names (``<pool>.pool``, ``<device>.device``), the first 8 bytes (magic, version, size) and the
liveness protocol in :mod:`elastic_kv.registry.files` (the owner holds an exclusive ``flock`` on its record).

Field offsets are computed by a cursor with natural alignment; the offsets of existing fields never move
within one version. A new field whose zero means "not written" is appended at the end of the record (files
are created zero-filled, so records of older writers read 0 there, and older readers ignore it); any other
change -- a field that moves, grows or changes meaning -- bumps the version.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Generic, TypeAlias, TypeVar

__all__ = [
    "HISTOGRAM_BOUNDS",
    "LATENCY_OPS",
    "RECORD_NO_LIMIT",
    "SNAPSHOT_APPENDED_INT_FIELDS",
    "SNAPSHOT_INT_FIELDS",
    "UNLIMITED",
    "DeviceLayout",
    "FloatField",
    "IntArray",
    "IntField",
    "ReadBuffer",
    "RecordLayout",
    "SlotLayout",
    "TextField",
    "WriteBuffer",
]

# Anything a field can be read from (a mapping, or a copy read with pread) or written to.
ReadBuffer: TypeAlias = bytes | bytearray | memoryview | mmap.mmap
WriteBuffer: TypeAlias = bytearray | memoryview | mmap.mmap

# A limit or budget of 0 means "no limit" (the same convention as PoolSnapshot.limit_bytes).
UNLIMITED = 0

# RecordLayout.flags: the pool's engine cannot follow a limit on it (kvctl refuses one; budgets still apply).
RECORD_NO_LIMIT = 1

# Latency operations a pool records (PoolRecord.observe) and the upper bounds of their histogram buckets,
# in seconds. Fixed by the layout version: a record written with other bounds would be misread. A page
# map costs tens of microseconds on a GPU, a pre-map of many pages milliseconds; a last bucket +Inf
# follows the bounds.
LATENCY_OPS: tuple[str, ...] = ("map", "unmap")
HISTOGRAM_BOUNDS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
)  # fmt: skip

# The integer fields of elastic_kv.snapshot.PoolSnapshot, in the order the record stores them. The record
# also stores `state` (text) and `timestamp` (float); `name` is the record's own name. A test checks this
# list against the dataclass, so a new snapshot field fails loudly until the layout version is bumped.
SNAPSHOT_INT_FIELDS: tuple[str, ...] = (
    "block_size_bytes", "page_size", "page_bytes", "blocks_per_page", "total_blocks", "used_blocks",
    "free_blocks", "available_blocks", "total_pages", "mapped_pages", "reserve_pages", "pending_pages",
    "inflight_pages", "mapped_bytes", "limit_bytes", "reserve_hits", "reserve_misses", "epoch", "preemptions",
    "draining_pages",
)  # fmt: skip
# Integer fields of PoolSnapshot added after layout version 2 was released. They are stored after ``flags``,
# so the offsets of version 2 do not move: a record of a writer that predates them reads 0 there, and a
# reader that predates them ignores them. Written and read under the same sequence lock as the others.
SNAPSHOT_APPENDED_INT_FIELDS: tuple[str, ...] = ("largest_request_bytes", "failed_requests")


_Number = TypeVar("_Number", int, float)


@dataclass(frozen=True, slots=True)
class _NumberField(Generic[_Number]):
    """One number at a fixed offset (relative to a base passed at access time), coded by ``codec``."""

    offset: int
    codec: struct.Struct

    def get(self, buf: ReadBuffer, base: int = 0) -> _Number:
        """The value stored at ``base + offset``."""
        value: _Number = self.codec.unpack_from(buf, base + self.offset)[0]
        return value

    def put(self, buf: WriteBuffer, value: _Number, base: int = 0) -> None:
        """Store ``value`` at ``base + offset`` (``struct.error`` if it does not fit the type)."""
        self.codec.pack_into(buf, base + self.offset, value)


@dataclass(frozen=True, slots=True)
class IntField(_NumberField[int]):
    """A signed or unsigned integer at a fixed offset (relative to a base passed at access time)."""


@dataclass(frozen=True, slots=True)
class FloatField(_NumberField[float]):
    """A float64 at a fixed offset."""


@dataclass(frozen=True, slots=True)
class TextField:
    """UTF-8 text in a fixed number of bytes, NUL-padded."""

    offset: int
    size: int

    def get(self, buf: ReadBuffer, base: int = 0) -> str:
        """The stored text (bytes after the first NUL are ignored; invalid UTF-8 is replaced)."""
        start = base + self.offset
        raw = bytes(buf[start : start + self.size])
        return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")

    def put(self, buf: WriteBuffer, value: str, base: int = 0) -> None:
        """Store ``value``; text longer than the field keeps its *tail* (the distinctive end of a path)."""
        raw = value.encode("utf-8")
        if len(raw) > self.size:
            raw = "…".encode() + raw[len(raw) - self.size + 3 :]
            # A cut at a byte position may split a multi-byte character: drop its orphaned continuation bytes.
            raw = raw[:3] + raw[3:].decode("utf-8", errors="ignore").encode("utf-8")
        start = base + self.offset
        buf[start : start + self.size] = raw.ljust(self.size, b"\0")


@dataclass(frozen=True, slots=True)
class IntArray:
    """``count`` consecutive int64 values, read in one call (the device's charge table, histogram buckets)."""

    offset: int
    count: int
    codec: struct.Struct  # "<{count}q", to read all values at once
    item: struct.Struct  # "<q"

    def get_all(self, buf: ReadBuffer, base: int = 0) -> tuple[int, ...]:
        """Every value, in index order, read with one ``unpack_from``."""
        values: tuple[int, ...] = self.codec.unpack_from(buf, base + self.offset)
        return values

    def get(self, buf: ReadBuffer, index: int, base: int = 0) -> int:
        """The value at ``index``."""
        value: int = self.item.unpack_from(buf, base + self.offset + 8 * index)[0]
        return value

    def put(self, buf: WriteBuffer, index: int, value: int, base: int = 0) -> None:
        """Store ``value`` at ``index``."""
        self.item.pack_into(buf, base + self.offset + 8 * index, value)


class _Cursor:
    """Hands out naturally aligned offsets, in declaration order."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start

    def _take(self, size: int, align: int) -> int:
        self.offset = (self.offset + align - 1) // align * align
        at = self.offset
        self.offset += size
        return at

    def integer(self, fmt: str) -> IntField:
        codec = struct.Struct("<" + fmt)
        return IntField(self._take(codec.size, codec.size), codec)

    def real(self) -> FloatField:
        return FloatField(self._take(8, 8), struct.Struct("<d"))

    def text(self, size: int) -> TextField:
        return TextField(self._take(size, 1), size)

    def integers(self, count: int) -> IntArray:
        return IntArray(self._take(8 * count, 8), count, struct.Struct(f"<{count}q"), struct.Struct("<q"))

    def histograms(
        self, ops: int, buckets: int
    ) -> tuple[tuple[IntField, ...], tuple[FloatField, ...], tuple[IntArray, ...]]:
        counts = tuple(self.integer("Q") for _ in range(ops))
        sums = tuple(self.real() for _ in range(ops))
        return counts, sums, tuple(self.integers(buckets) for _ in range(ops))

    def align(self, boundary: int) -> int:
        self.offset = (self.offset + boundary - 1) // boundary * boundary
        return self.offset


class RecordLayout:
    """A pool record, version 2: identity, control fields, published statistics, latency histograms.

    Writers: the owner writes identity, ``charged_bytes`` and the statistics; ``kvctl`` (any process) writes
    ``limit_bytes``/``limit_revision``/``trim_revision``, always under the device lock of the record's device.
    ``stats_seq`` is a sequence lock over the statistics and histogram region: odd while the owner writes,
    so readers retry instead of returning a torn copy.
    """

    MAGIC = "EKVP"
    VERSION = 2
    SIZE = 4096  # one page: the mapping is never resized

    _c = _Cursor()
    magic = _c.text(4)
    version = _c.integer("H")
    header_size = _c.integer("H")  # == SIZE; lets a reader reject a truncated file before touching fields
    token = _c.integer("Q")  # random per record incarnation; the device slot holds the same token
    pid = _c.integer("i")
    slot = _c.integer("i")  # index in the device's charge table, -1 until claimed
    start_ticks = _c.integer("Q")  # owner start time (/proc/<pid>/stat field 22) -- defeats pid reuse
    pid_namespace = _c.integer("Q")  # inode of the owner's /proc/self/ns/pid
    created_at = _c.real()
    limit_bytes = _c.integer("q")  # UNLIMITED (0) or the pool's physical limit
    limit_revision = _c.integer("Q")  # bumped by every limit change
    trim_revision = _c.integer("Q")  # bumped by every trim request
    charged_bytes = _c.integer(
        "q"
    )  # copy of the device slot's charge, for readers; the slot is authoritative
    name = _c.text(64)
    device = _c.text(64)
    engine = _c.text(32)
    model = _c.text(192)

    _c.align(64)
    stats_seq = _c.integer("Q")
    stats_start = _c.offset
    published = _c.integer("Q")  # number of publish() calls; 0 = no statistics yet
    snapshot_state = _c.text(16)
    snapshot_timestamp = _c.real()
    snapshot_ints = _c.integers(len(SNAPSHOT_INT_FIELDS))
    # Per latency op: observation count, sum of seconds, one count per bucket (non-cumulative, +Inf last).
    hist_count, hist_sum, hist_buckets = _c.histograms(len(LATENCY_OPS), len(HISTOGRAM_BOUNDS) + 1)
    stats_end = _c.offset
    # Set when the record is created (RECORD_NO_LIMIT ...); 0 in records of writers that predate it.
    flags = _c.integer("Q")
    appended_snapshot_ints = _c.integers(len(SNAPSHOT_APPENDED_INT_FIELDS))
    del _c


class SlotLayout:
    """One entry of a device's slot table: who owns the charge at the same index of the charge table."""

    SIZE = 96
    _c = _Cursor()
    token = _c.integer("Q")  # 0 = free slot
    pid = _c.integer("i")
    start_ticks = _c.integer("Q")
    pid_namespace = _c.integer("Q")
    name = _c.text(64)
    del _c


class DeviceLayout:
    """A device budget file, version 1: the GPU-wide budget and the charge of every pool on that device.

    Charges live here, one int64 per slot, rather than in the pool records so that a charge is a single
    store made under the device lock: a process killed at any instant leaves either the old or the new
    value, never a total that disagrees with its parts.
    """

    MAGIC = "EKVD"
    VERSION = 1
    SLOTS = 128  # pools per device; far above what one GPU serves (each engine has one or a few pools)

    _c = _Cursor()
    magic = _c.text(4)
    version = _c.integer("H")
    slot_count = _c.integer("H")
    budget_bytes = _c.integer("q")  # UNLIMITED (0) or the GPU-wide budget
    budget_revision = _c.integer("Q")
    total_bytes = _c.integer("q")  # device memory as the last pool creator reported it; 0 = unknown
    device = _c.text(64)
    _c.align(128)
    charges = _c.integers(SLOTS)
    slots_start = _c.align(64)
    SIZE = slots_start + SLOTS * SlotLayout.SIZE
    # Every slot's token in one unpack (from slots_start): finding occupied slots is on the refusal path.
    slot_tokens = struct.Struct("<" + f"Q{SlotLayout.SIZE - 8}x" * SLOTS)
    del _c
