"""A host-memory arena shared by the engines of one host: where asleep models keep their weights.

Problem. An engine put to sleep at level 1 copies its weights from the GPU to host memory and frees the GPU
copy; waking copies them back. Copies between the GPU and *page-locked* host memory run at the link's speed
(about 51 GiB/s each way on an H200: 0.27 s for 13.6 GiB of 8B weights), but allocating fresh page-locked
memory is what costs: 2.1 GiB/s on the same machine (6.4 s for those weights) because every page is faulted
in, zeroed and pinned. vLLM's own sleep allocates per tensor at every sleep, and keeping each engine's
buffers instead would make host memory grow with the number of models, not with the number asleep.

Design. One file on a memory file system (tmpfs: ``/dev/shm``), created and filled once by whoever owns the
host budget (``elastic-kv serve``), mapped by every engine process. Its size *is* the host budget for asleep
weights, so host memory stays bounded however many models there are. An engine going to sleep takes one
contiguous *extent* large enough for its weights, keeps it while asleep and gives it back once awake;
another engine's sleep then reuses the same already-resident pages. Pinning resident pages for the copy
(``cudaHostRegister``, done by the engine plugin) runs at about 31 GiB/s, an order of magnitude above
allocating new pinned memory.

File layout (little-endian, versioned; :class:`_Layout`): a header with the data region's offset and size
and a table of :data:`MAX_EXTENTS` extents (offset, size, token, owner process, owner name), then the data
region, aligned to :data:`ALIGN` (2 MiB: transparent huge pages and the GPU's copy engines like it).

Concurrency. Taking and giving back extents happen under an exclusive ``flock`` on the file, so processes
are serialised; a thread lock complements it within one process. Reads of the table without the lock may
be a moment old (what ``usage`` is for: a controller's estimate). An extent whose owner process died (PID
gone or reused, checked in the owner's PID namespace) is reclaimed when a ``take`` finds no room, or by
:meth:`HostArena.reclaim_dead`; an owner in another PID namespace is never presumed dead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import secrets
import stat
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from elastic_kv.errors import ConfigError
from elastic_kv.registry.files import ProcessIdentity, owner_is_dead, pid_namespace
from elastic_kv.sizes import format_bytes

__all__ = ["ALIGN", "ENV_HOST_ARENA", "MAX_EXTENTS", "Extent", "HostArena"]

ENV_HOST_ARENA = "ELASTIC_KV_HOST_ARENA"  # the arena's path, for engines started by a controller
ALIGN = 2 << 20
MAX_EXTENTS = 256


class _Layout:
    MAGIC = 0x31_54_53_4F_48_56_4B_45  # "EKVHOST1"
    VERSION = 1
    # magic, version, extent count, data offset, data bytes, creator pid, creator start ticks, creator ns
    HEADER = struct.Struct("<QIIQQQQQ")
    # offset, size, token, pid, start ticks, pid namespace, owner name
    ENTRY = struct.Struct("<QQQQQQ48s")
    ENTRIES_AT = 64
    DATA_AT = ALIGN  # the table ends far below it: 64 + 256 * 96 bytes


assert _Layout.HEADER.size <= _Layout.ENTRIES_AT
assert _Layout.ENTRIES_AT + MAX_EXTENTS * _Layout.ENTRY.size <= _Layout.DATA_AT


@dataclass(frozen=True, slots=True)
class Extent:
    """A part of the arena's data region: ``size`` bytes at ``offset`` (from the data region's start), owned
    by ``owner`` while taken. ``token`` proves ownership when it is given back."""

    offset: int
    size: int
    token: int
    owner: str
    pid: int = 0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostArena:
    """One arena file, opened in this process (see the module docstring). Build with :meth:`create` or
    :meth:`open`; :meth:`close` when done (the creator also :meth:`remove`-s it)."""

    def __init__(self, path: Path, fd: int, data_bytes: int) -> None:
        """Use :meth:`create` or :meth:`open`."""
        self.path = path
        self._fd = fd
        self._data_bytes = data_bytes
        self._table = mmap.mmap(fd, _Layout.DATA_AT)
        self._data: mmap.mmap | None = None
        self._threads = threading.Lock()
        self._namespace = pid_namespace()

    # -- life cycle -------------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, nbytes: int, *, prefault: bool = True) -> HostArena:
        """Create the arena file ``path`` with ``nbytes`` of data (rounded up to :data:`ALIGN`), mode 0600.

        ``prefault`` allocates every page now (``posix_fallocate``: about 10 GiB/s on tmpfs), so no later
        sleep pays for it, and so that a file system too small for the budget is found at start-up:
        :class:`ConfigError` names the room there is. A file left at ``path`` by a dead creator is
        replaced; one whose creator lives is refused (``ConfigError``).
        """
        if nbytes <= 0:
            raise ConfigError(f"host arena {path}: size must be > 0, got {nbytes}")
        data_bytes = _aligned(nbytes)
        if path.exists():
            cls._replace_stale(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, _Layout.DATA_AT + data_bytes)
            if prefault:
                try:
                    os.posix_fallocate(fd, _Layout.DATA_AT, data_bytes)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                        raise
                    free = os.statvfs(path.parent)
                    raise ConfigError(
                        f"host arena {path}: {path.parent} has room for "
                        f"{format_bytes(free.f_bavail * free.f_frsize)}, the host budget needs "
                        f"{format_bytes(data_bytes)}; lower the host budget or put the arena on a larger "
                        "memory file system"
                    ) from None
            me = ProcessIdentity.current()
            header = _Layout.HEADER.pack(
                _Layout.MAGIC, _Layout.VERSION, MAX_EXTENTS, _Layout.DATA_AT, data_bytes,
                me.pid, me.start_ticks, me.pid_namespace,
            )  # fmt: skip
            os.pwrite(fd, header, 0)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, data_bytes)

    @staticmethod
    def _replace_stale(path: Path) -> None:
        try:
            with open(path, "rb") as f:
                raw = f.read(_Layout.HEADER.size)
        except OSError:
            raw = b""
        if len(raw) == _Layout.HEADER.size:
            magic, _, _, _, _, pid, ticks, ns = _Layout.HEADER.unpack(raw)
            if magic == _Layout.MAGIC and not owner_is_dead(pid, ticks, ns, pid_namespace()):
                raise ConfigError(
                    f"host arena {path} belongs to a running process (pid {pid}); use another registry "
                    "directory for a second server"
                )
        path.unlink(missing_ok=True)

    @classmethod
    def open(cls, path: Path) -> HostArena:
        """Open an existing arena; :class:`ConfigError` if it is missing, another user's or another format."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"host arena {path}: cannot open it: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            raw = os.pread(fd, _Layout.HEADER.size, 0)
            if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode) or len(raw) < _Layout.HEADER.size:
                raise ConfigError(f"host arena {path} is not an arena file of this user")
            magic, version, count, data_at, data_bytes, *_ = _Layout.HEADER.unpack(raw)
            expected = (_Layout.MAGIC, _Layout.VERSION, MAX_EXTENTS, _Layout.DATA_AT)
            if (magic, version, count, data_at) != expected:
                raise ConfigError(f"host arena {path} has another format or version")
            if st.st_size < data_at + data_bytes:
                raise ConfigError(f"host arena {path} is shorter than its header says")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, data_bytes)

    def close(self) -> None:
        """Unmap and close (extents this process holds stay taken: give them back first)."""
        for mapping in (self._data, self._table):
            if mapping is not None:
                # A view of it still alive keeps it: the mapping goes when that view does.
                with contextlib.suppress(BufferError):
                    mapping.close()
        self._data = None
        os.close(self._fd)

    def remove(self) -> None:
        """Delete the file (its memory goes back to the system once every process unmapped it)."""
        self.path.unlink(missing_ok=True)

    # -- the table --------------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Bytes of the data region."""
        return self._data_bytes

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._threads:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _entries(self) -> Iterator[tuple[int, tuple[int, int, int, int, int, int, bytes]]]:
        for i in range(MAX_EXTENTS):
            yield i, _Layout.ENTRY.unpack_from(self._table, _Layout.ENTRIES_AT + i * _Layout.ENTRY.size)

    def extents(self) -> list[Extent]:
        """Every taken extent, by offset (read without the lock: may be a moment old)."""
        out = [
            Extent(off, size, token, name.rstrip(b"\0").decode(errors="replace"), pid)
            for _, (off, size, token, pid, _, _, name) in self._entries()
            if token
        ]
        return sorted(out, key=lambda e: e.offset)

    def used_bytes(self) -> int:
        """Bytes in taken extents."""
        return sum(e.size for e in self.extents())

    def largest_free(self) -> int:
        """The largest extent a :meth:`take` could return now (ignoring extents of dead owners)."""
        return max((size for _, size in self._gaps(self.extents())), default=0)

    def would_take(self, sizes: Sequence[int]) -> list[bool]:
        """Which of extents of ``sizes``, taken one after another now, :meth:`take` would place: one that
        finds no room is skipped and the next one tried, as a caller that goes on without it would (read
        without the lock, ignoring extents of dead owners; sizes of 0 are placed, taking nothing)."""
        taken = self.extents()
        out = []
        for nbytes in sizes:
            size = _aligned(nbytes) if nbytes > 0 else 0
            fit = next((off for off, gap in self._gaps(taken) if gap >= size), None) if size else 0
            if fit is not None and size:
                taken = sorted([*taken, Extent(fit, size, 0, "")], key=lambda e: e.offset)
            out.append(fit is not None)
        return out

    def _gaps(self, taken: list[Extent]) -> Iterator[tuple[int, int]]:
        at = 0
        for e in taken:
            if e.offset > at:
                yield at, e.offset - at
            at = max(at, e.offset + e.size)
        if at < self._data_bytes:
            yield at, self._data_bytes - at

    def take(self, nbytes: int, owner: str) -> Extent | None:
        """An extent of at least ``nbytes`` (rounded up to :data:`ALIGN`) for ``owner`` (a name for humans,
        at most 48 bytes), the lowest that fits; ``None`` when none fits, even after reclaiming the extents of
        dead owners, or the table is full. ``ValueError`` for ``nbytes <= 0``."""
        if nbytes <= 0:
            raise ValueError(f"an extent needs a positive size, got {nbytes}")
        size = _aligned(nbytes)
        with self._locked():
            for attempt in range(2):
                free_slot = next((i for i, entry in self._entries() if not entry[2]), None)
                fit = next((off for off, gap in self._gaps(self.extents()) if gap >= size), None)
                if free_slot is not None and fit is not None:
                    me = ProcessIdentity.current()
                    token = secrets.randbits(63) | 1
                    entry = _Layout.ENTRY.pack(
                        fit, size, token, me.pid, me.start_ticks, me.pid_namespace, owner.encode()[:48]
                    )
                    self._table[self._slot_at(free_slot) : self._slot_at(free_slot + 1)] = entry
                    return Extent(fit, size, token, owner, me.pid)
                if attempt == 0 and not self._reclaim_dead_locked():
                    return None
        return None

    def give_back(self, extent: Extent) -> None:
        """Return ``extent`` to the arena. Idempotent: an extent already given back (or reclaimed) is
        ignored."""
        with self._locked():
            for i, (off, _, token, *_rest) in self._entries():
                if token == extent.token and off == extent.offset:
                    self._table[self._slot_at(i) : self._slot_at(i + 1)] = bytes(_Layout.ENTRY.size)
                    return

    def reclaim_dead(self) -> list[Extent]:
        """Give back every extent whose owner process is gone; the extents reclaimed."""
        with self._locked():
            return self._reclaim_dead_locked()

    def _reclaim_dead_locked(self) -> list[Extent]:
        gone = []
        for i, (off, size, token, pid, ticks, ns, name) in self._entries():
            if token and owner_is_dead(pid, ticks, ns, self._namespace):
                self._table[self._slot_at(i) : self._slot_at(i + 1)] = bytes(_Layout.ENTRY.size)
                gone.append(Extent(off, size, token, name.rstrip(b"\0").decode(errors="replace"), pid))
        return gone

    @staticmethod
    def _slot_at(i: int) -> int:
        return _Layout.ENTRIES_AT + i * _Layout.ENTRY.size

    # -- the data ---------------------------------------------------------------------------------------

    def data(self) -> mmap.mmap:
        """The data region, mapped shared and writable in this process (mapped on first use)."""
        if self._data is None:
            self._data = mmap.mmap(self._fd, self._data_bytes, offset=_Layout.DATA_AT)
        return self._data

    def address(self, extent: Extent) -> int:
        """The virtual address of ``extent``'s first byte in this process (for pinning and copies)."""
        if not 0 <= extent.offset <= extent.offset + extent.size <= self._data_bytes:
            raise ValueError(f"extent {extent} lies outside the arena ({self._data_bytes} bytes)")
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.data()))
        return base + extent.offset

    def view(self, extent: Extent) -> memoryview:
        """``extent``'s bytes as a writable memoryview of the shared mapping."""
        if not 0 <= extent.offset <= extent.offset + extent.size <= self._data_bytes:
            raise ValueError(f"extent {extent} lies outside the arena ({self._data_bytes} bytes)")
        return memoryview(self.data())[extent.offset : extent.offset + extent.size]
