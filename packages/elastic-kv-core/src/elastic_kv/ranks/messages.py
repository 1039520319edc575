"""Binary, versioned messages of the ranks protocol (coordinator <-> rank).

Why ``struct`` and not msgpack or pickle: every message has a fixed schema (an opcode, a few 64-bit ids and a
list of page numbers), so a fixed little-endian layout is the smallest, fastest and most explicit encoding:
decoding is two ``struct.unpack_from`` calls and a length check, a page list packs into one contiguous
``uint32`` array, the layout can be read from C++ later without a library, and the core package gains no
dependency that an engine might pin differently. A schemaless format (msgpack) would need the same validation
on top; pickle executes code chosen by the sender and is never used (kvcached's ``tp_ipc_util`` unpickles
whatever reaches a world-connectable ``/tmp`` socket).

Layout (all little-endian). The 12-byte prefix is frozen for every protocol version, so that a peer of another
version can always be answered with an error naming the version it speaks::

    prefix   magic "EK" | version u8 | kind u8 | request_id u64
    request  pool u16 | flags u16 | tx u64 | epoch u64 | finished_epoch u64 | n_pages u32 | pages u32[n_pages]
    reply    rank u32 | status u8 | code u8 | pool u16 | flags u16 | n_pages u32 | msg_len u32
             | [info: RankInfo, when flags & HAS_INFO] | pages u32[n_pages] | message utf-8[msg_len]

``kind`` is the :class:`Op` of a request, or ``REPLY_KIND`` for a reply. Every decoder checks the exact
length, so a truncated or padded message is rejected as :class:`MessageError` rather than half-read.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

__all__ = [
    "MAX_MESSAGE_BYTES",
    "NO_EPOCH",
    "PROTOCOL_VERSION",
    "REPLY_KIND",
    "Code",
    "MessageError",
    "Op",
    "RankInfo",
    "Reply",
    "Request",
    "Status",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "peek_prefix",
]

PROTOCOL_VERSION = 1
MAGIC = b"EK"
REPLY_KIND = 0x80
NO_EPOCH = 0  # an unmap tagged NO_EPOCH is applied at once; real epochs start at 1
MAX_PAGES = (1 << 32) - 1
# A page list of 16 M pages is 64 MiB: far more than one pool has; anything larger is garbage.
MAX_MESSAGE_BYTES = 64 << 20

_PREFIX = struct.Struct("<2sBBQ")
_REQUEST = struct.Struct("<HHQQQI")
_REPLY = struct.Struct("<IBBHHII")
_INFO = struct.Struct("<IIIIB3xQQQQQ")
_HAS_INFO = 1
_U64 = (1 << 64) - 1


class MessageError(ValueError):
    """Bytes that are not a well-formed message of this protocol version (the receiver answers MALFORMED)."""

    def __init__(self, message: str, *, code: Code | None = None, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = Code.MALFORMED if code is None else code
        self.request_id = request_id


class Op(enum.IntEnum):
    """What a request asks a rank to do (the ``kind`` byte of a request)."""

    MAP = 1  # map `pages` all-or-nothing under transaction `tx`
    ROLLBACK = 2  # undo map `tx` if it was applied; tombstone it if it never arrived
    PREPARE = 3  # unmap `pages` keeping their handles, after work through `epoch` finished
    COMMIT = 4  # release the handles of prepared `tx`; idempotent
    ABORT = 5  # restore the handles of prepared `tx`; tombstone it if it never arrived; idempotent
    SYNC = 6  # apply queued unmaps whose epoch has finished; reply with RankInfo
    STATUS = 7  # introspection: RankInfo and the mapped pages


class Status(enum.IntEnum):
    """Outcome of one request on one rank."""

    OK = 0  # done (for PREPARE: the pages are unmapped and their handles retained)
    QUEUED = 1  # PREPARE accepted and validated, applied once work through its epoch finished
    ERROR = 2  # not done; `code` says why; the rank's state is unchanged unless code is INCONSISTENT


class Code(enum.IntEnum):
    """Why a request failed. Each code has one meaning and one reaction on the coordinator."""

    NONE = 0
    MALFORMED = 1  # undecodable bytes
    VERSION = 2  # a protocol version this rank does not speak
    UNKNOWN_OP = 3  # an opcode this version does not define
    BAD_ARGUMENT = 4  # ValueError from the data plane: page out of range, double map, unmapped page
    EXHAUSTED = 5  # PoolExhausted: nothing was mapped
    INCONSISTENT = 6  # the rank's pool is in the consistency-error state
    REFUSED = 7  # the transaction's recorded state forbids this (late prepare of an aborted tx, ...)
    UNKNOWN_TX = 8  # commit of a transaction this rank has no record of
    UNKNOWN_POOL = 9  # no pool with this id on this rank
    BUSY = 10  # a page is still retiring behind an epoch that did not finish in time
    INTERNAL = 11  # an unexpected exception; the message carries it
    SHUTTING_DOWN = 12  # the listener is draining and takes no new calls
    BACKEND = 13  # a driver call failed (not memory); the data plane rolled it back: nothing changed


@dataclass(frozen=True, slots=True)
class Request:
    """One request from the coordinator, identical for every rank (so that it can ride a broadcast).

    ``tx`` names the transaction (MAP/ROLLBACK/PREPARE/COMMIT/ABORT), unique per pool and increasing.
    ``epoch`` (PREPARE only) is the last engine step whose queued device work may still read the pages.
    ``finished_epoch`` piggybacks the coordinator's knowledge that work through that epoch finished on every
    rank, so that ranks advance their fence without a message of its own.
    """

    op: Op
    request_id: int
    pool: int = 0
    tx: int = 0
    pages: tuple[int, ...] = ()
    epoch: int = NO_EPOCH
    finished_epoch: int = NO_EPOCH


@dataclass(frozen=True, slots=True)
class RankInfo:
    """A rank's view of one pool, returned by STATUS and SYNC (for handshakes, tests and metrics)."""

    pid: int
    num_pages: int  # logical pages the pool can hold
    num_mapped: int  # logical pages mapped now (retiring pages included until they are unmapped)
    queued_unmaps: int  # transactions waiting for their epoch
    consistent: bool
    live_handles: int  # the backend's physical handles (zero pages and the handle pool included)
    cached_handles: int  # handles kept for reuse by the handle pool
    mapped_bytes: int
    finished_epoch: int
    last_tx: int  # highest transaction id this rank has seen for the pool


@dataclass(frozen=True, slots=True)
class Reply:
    """One rank's answer to one request; ``request_id`` echoes the request's so stale replies are dropped."""

    request_id: int
    rank: int
    status: Status
    code: Code = Code.NONE
    pool: int = 0
    message: str = ""
    pages: tuple[int, ...] = ()  # STATUS: the pool's mapped pages (retiring ones excluded), sorted
    info: RankInfo | None = None

    @property
    def ok(self) -> bool:
        """True when the request was carried out (now, or queued behind its epoch)."""
        return self.status is not Status.ERROR


def _check_u(value: int, bits: int, what: str) -> None:
    if not 0 <= value < (1 << bits):
        raise ValueError(f"{what}={value} does not fit in an unsigned {bits}-bit field")


def _pack_pages(pages: tuple[int, ...]) -> bytes:
    try:
        return struct.pack(f"<{len(pages)}I", *pages)
    except struct.error:
        bad = next(p for p in pages if not (isinstance(p, int) and 0 <= p <= MAX_PAGES))
        raise ValueError(f"page {bad!r} is not an integer in [0, {MAX_PAGES}]") from None


def encode_request(req: Request) -> bytes:
    """Serialize a request. ValueError when a field does not fit its wire type."""
    _check_u(req.request_id, 64, "request_id")
    _check_u(req.pool, 16, "pool")
    _check_u(req.tx, 64, "tx")
    _check_u(req.epoch, 64, "epoch")
    _check_u(req.finished_epoch, 64, "finished_epoch")
    head = _PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(req.op), req.request_id) + _REQUEST.pack(
        req.pool, 0, req.tx, req.epoch, req.finished_epoch, len(req.pages)
    )
    return head + _pack_pages(req.pages)


def encode_reply(rep: Reply) -> bytes:
    """Serialize a reply. ValueError when a field does not fit its wire type."""
    msg = rep.message.encode("utf-8", "replace")
    flags = _HAS_INFO if rep.info is not None else 0
    parts = [
        _PREFIX.pack(MAGIC, PROTOCOL_VERSION, REPLY_KIND, rep.request_id),
        _REPLY.pack(rep.rank, int(rep.status), int(rep.code), rep.pool, flags, len(rep.pages), len(msg)),
    ]
    if rep.info is not None:
        i = rep.info
        parts.append(
            _INFO.pack(
                i.pid,
                i.num_pages,
                i.num_mapped,
                i.queued_unmaps,
                int(i.consistent),
                i.live_handles,
                i.cached_handles,
                i.mapped_bytes,
                i.finished_epoch,
                i.last_tx,
            )
        )
    parts.append(_pack_pages(rep.pages))
    parts.append(msg)
    return b"".join(parts)


def peek_prefix(data: bytes | memoryview) -> tuple[int, int, int]:
    """Return ``(version, kind, request_id)`` of a message; MessageError when even the prefix is bad."""
    if len(data) < _PREFIX.size:
        raise MessageError(f"message of {len(data)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, kind, request_id = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise MessageError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    return version, kind, request_id


def _unpack_pages(data: bytes | memoryview, offset: int, n: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{n}I", data, offset) if n else ()


def decode_request(data: bytes | memoryview) -> Request:
    """Parse a request. MessageError (with the request id when readable) on anything malformed."""
    version, kind, request_id = peek_prefix(data)
    if version != PROTOCOL_VERSION:
        raise MessageError(
            f"protocol version {version}, this rank speaks {PROTOCOL_VERSION}",
            code=Code.VERSION,
            request_id=request_id,
        )
    try:
        op = Op(kind)
    except ValueError:
        raise MessageError(f"unknown op {kind}", code=Code.UNKNOWN_OP, request_id=request_id) from None
    base = _PREFIX.size + _REQUEST.size
    if len(data) < base:
        raise MessageError(f"request of {len(data)} bytes is shorter than its header", request_id=request_id)
    pool, _flags, tx, epoch, finished, n = _REQUEST.unpack_from(data, _PREFIX.size)
    if len(data) != base + 4 * n:
        raise MessageError(
            f"request declares {n} pages but carries {len(data) - base} bytes of them", request_id=request_id
        )
    return Request(op, request_id, pool, tx, _unpack_pages(data, base, n), epoch, finished)


def decode_reply(data: bytes | memoryview) -> Reply:
    """Parse a reply. MessageError on anything malformed or of another protocol version."""
    version, kind, request_id = peek_prefix(data)
    if kind != REPLY_KIND:
        raise MessageError(f"kind {kind} is not a reply", request_id=request_id)
    if version != PROTOCOL_VERSION:
        raise MessageError(f"reply of protocol version {version}", code=Code.VERSION, request_id=request_id)
    off = _PREFIX.size
    if len(data) < off + _REPLY.size:
        raise MessageError("reply shorter than its header", request_id=request_id)
    rank, status, code, pool, flags, n, msg_len = _REPLY.unpack_from(data, off)
    off += _REPLY.size
    info = None
    if flags & _HAS_INFO:
        if len(data) < off + _INFO.size:
            raise MessageError("reply truncated in its rank info", request_id=request_id)
        f = _INFO.unpack_from(data, off)
        info = RankInfo(f[0], f[1], f[2], f[3], bool(f[4]), f[5], f[6], f[7], f[8], f[9])
        off += _INFO.size
    if len(data) != off + 4 * n + msg_len:
        raise MessageError("reply length does not match its header", request_id=request_id)
    try:
        st, cd = Status(status), Code(code)
    except ValueError:
        raise MessageError(
            f"reply with unknown status {status} or code {code}", request_id=request_id
        ) from None
    pages = _unpack_pages(data, off, n)
    message = bytes(data[off + 4 * n :]).decode("utf-8", "replace")
    return Reply(request_id, rank, st, cd, pool, message, pages, info)
