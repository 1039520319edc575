"""Local transport: Unix-domain sockets between processes of one host that share no engine channel.

Rank side, :class:`SocketListener`: one thread serves one :class:`~elastic_kv.ranks.rank.Rank` on a socket
``<dir>/<instance>.r<rank>.sock``. Requests are applied one at a time in that thread, in arrival order, so
there is at most one *in-flight call*. Coordinator side, :class:`SocketTransport`: one persistent connection
per rank (kvcached opened a connection per message); a broadcast writes the request to every rank first, then
gathers the replies with one selector, so the ranks work in parallel.

Safety (kvcached's sockets live in ``/tmp`` with the default umask and unpickle what they read): the
directory is per user, created ``0700`` and refused if it is anyone else's or open to others; sockets are
``0600``; both ends check the peer's uid (``SO_PEERCRED``); a message is parsed, never executed; names carry
an engine-instance token so that two engines of one user never meet.

Framing: a ``u32`` little-endian length, then one message. A frame that is too long cannot be resynchronised:
the listener answers MALFORMED and closes that connection, keeping the others and itself alive.

Shutdown (:meth:`SocketListener.close`): stop accepting (new connects are refused at once), wake a call
blocked on the rank's epoch fence, let the in-flight call finish and send its reply, answer SHUTTING_DOWN to
requests already received, close every connection (waking the coordinator's pending calls with EOF), then
remove the socket file. If the in-flight call does not finish in bounded time, ``close`` logs it, keeps the
file and returns False; calling ``close`` again finishes the job.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import selectors
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from elastic_kv.errors import ConfigError
from elastic_kv.ranks.messages import (
    MAX_MESSAGE_BYTES,
    Code,
    MessageError,
    Reply,
    Request,
    Status,
    decode_reply,
    encode_reply,
    encode_request,
    peek_prefix,
)
from elastic_kv.ranks.rank import Rank
from elastic_kv.ranks.transport import NoReply, Outcome

__all__ = ["SocketListener", "SocketTransport", "new_instance_name", "socket_dir", "socket_path"]

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_RECV_BYTES = 1 << 16
_SO_PEERCRED = struct.Struct("3i")


# --- naming --------------------------------------------------------------------------------------
def socket_dir(base: str | os.PathLike[str] | None = None) -> Path:
    """The per-user socket directory ``<base>/elastic-kv-<uid>`` (``base`` defaults to the system temp dir).

    Created with mode 0700. ConfigError when it exists but is a symlink, not a directory, owned by another
    user, or accessible to group/others -- someone could then plant or intercept sockets.
    """
    root = Path(base) if base is not None else Path(tempfile.gettempdir())
    directory = root / f"elastic-kv-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{directory} is not a directory (a symlink or file?); remove it")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise ConfigError(f"{directory} has mode {oct(st.st_mode & 0o777)}; it must be 0700 (chmod 700 it)")
    return directory


def new_instance_name() -> str:
    """A fresh engine-instance token: the creating process's pid and 32 random bits."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def socket_path(instance: str, rank: int, directory: str | os.PathLike[str] | None = None) -> Path:
    """Where rank ``rank`` of engine instance ``instance`` listens. ConfigError if the path is too long."""
    if not _INSTANCE_RE.match(instance):
        raise ValueError(f"instance name {instance!r} must match {_INSTANCE_RE.pattern}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    path = (Path(directory) if directory is not None else socket_dir()) / f"{instance}.r{rank}.sock"
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ConfigError(f"socket path {path} exceeds {_SUN_PATH_MAX} bytes; use a shorter socket directory")
    return path


def _peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _SO_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


# --- framing -------------------------------------------------------------------------------------
def _frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


class _FrameReader:
    """Accumulates bytes from a stream socket and splits them into length-prefixed frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def frames(self) -> Iterator[bytes]:
        """Complete frames received so far; MessageError for an oversized length (stream unrecoverable)."""
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf, 0)
            if n > MAX_MESSAGE_BYTES:
                raise MessageError(f"frame of {n} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
            if len(self._buf) < _LEN.size + n:
                return
            frame = bytes(self._buf[_LEN.size : _LEN.size + n])
            del self._buf[: _LEN.size + n]
            yield frame


# --- rank side -----------------------------------------------------------------------------------
class SocketListener:
    """Serves ``rank`` on the Unix socket ``path`` from a background thread until :meth:`close`.

    Binding replaces a stale socket file (nobody accepting on it) and refuses a live one (ConfigError: another
    listener of the same name exists). The socket file is mode 0600.
    """

    def __init__(self, rank: Rank, path: str | os.PathLike[str], *, send_timeout: float = 5.0) -> None:
        """``send_timeout``: seconds a reply may take to be written before its connection is dropped."""
        self.rank = rank
        self.path = Path(path)
        self._send_timeout = send_timeout
        self._lsock = self._bind(self.path)
        self._inode = os.stat(self.path).st_ino
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._in_flight = False
        self._close_lock = threading.Lock()
        self._removed = False
        self._thread = threading.Thread(target=self._serve, name=f"elastic-kv-rank{rank.rank}", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(path: Path) -> socket.socket:
        if path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(os.fspath(path))
            except OSError:
                path.unlink()  # stale: its listener is gone
            else:
                raise ConfigError(
                    f"{path} is in use by a live listener (engine instance names must be unique)"
                )
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.fspath(path))
            os.chmod(path, 0o600)  # the 0700 directory already keeps others out; belt and braces
            sock.listen(16)
        except BaseException:
            sock.close()
            raise
        return sock

    @property
    def in_flight(self) -> bool:
        """True while a request is being applied."""
        return self._in_flight

    @property
    def serving(self) -> bool:
        """True until the serving thread has exited."""
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> bool:
        """Shut down (see the module docstring). True when drained and the socket file is removed; False when
        the in-flight call did not finish within ``timeout`` seconds (the file is kept; call again)."""
        with self._close_lock:
            if self._removed:
                return True
            if not self._stopping.is_set():
                self._stopping.set()
                with contextlib.suppress(OSError):
                    self._lsock.shutdown(socket.SHUT_RDWR)  # refuse new connects now, from any thread
                self.rank.interrupt()
                with contextlib.suppress(OSError):
                    self._wake_w.send(b"x")
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning(
                    "listener %s did not drain its in-flight call within %.1fs; keeping its socket file, "
                    "call close() again",
                    self.path,
                    timeout,
                )
                return False
            self._lsock.close()
            self._wake_w.close()
            try:
                if os.stat(self.path).st_ino == self._inode:  # never remove a successor's socket
                    self.path.unlink()
            except FileNotFoundError:
                pass
            self._removed = True
            return True

    # --- serving thread --------------------------------------------------------------------------
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._lsock, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        conns: dict[socket.socket, _FrameReader] = {}
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select():
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._lsock:
                        self._accept(sel, conns)
                    elif sock is not self._wake_r:
                        self._read(sock, sel, conns)
                    if self._stopping.is_set():
                        break
        except Exception:
            logger.exception("listener %s failed", self.path)
        finally:
            for conn in conns:
                conn.close()
            sel.close()
            self._wake_r.close()

    def _accept(self, sel: selectors.BaseSelector, conns: dict[socket.socket, _FrameReader]) -> None:
        try:
            conn, _ = self._lsock.accept()
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.ECONNABORTED, errno.EINTR):
                return
            sel.unregister(self._lsock)  # shut down (EINVAL): accept no more
            return
        if _peer_uid(conn) != os.getuid():
            logger.warning("listener %s: refused a connection from uid %d", self.path, _peer_uid(conn))
            conn.close()
            return
        conn.settimeout(self._send_timeout)
        conns[conn] = _FrameReader()
        sel.register(conn, selectors.EVENT_READ, None)

    def _drop(
        self, conn: socket.socket, sel: selectors.BaseSelector, conns: dict[socket.socket, _FrameReader]
    ) -> None:
        sel.unregister(conn)
        del conns[conn]
        conn.close()

    def _read(
        self, conn: socket.socket, sel: selectors.BaseSelector, conns: dict[socket.socket, _FrameReader]
    ) -> None:
        try:
            data = conn.recv(_RECV_BYTES)
        except OSError:
            data = b""
        if not data:
            self._drop(conn, sel, conns)
            return
        reader = conns[conn]
        reader.feed(data)
        try:
            for frame in reader.frames():
                if self._stopping.is_set():
                    reply = self._refusal(frame, Code.SHUTTING_DOWN, "the listener is shutting down")
                else:
                    self._in_flight = True
                    try:
                        reply = self.rank.handle(frame)
                    finally:
                        self._in_flight = False
                conn.sendall(_frame(reply))
        except MessageError as exc:  # unframeable stream: answer once, then drop only this connection
            logger.warning("listener %s: %s; closing that connection", self.path, exc)
            with contextlib.suppress(OSError):
                conn.sendall(_frame(self._refusal(b"", Code.MALFORMED, str(exc))))
            self._drop(conn, sel, conns)
        except OSError as exc:  # the peer stopped reading or went away
            logger.warning("listener %s: dropping a connection: %s", self.path, exc)
            self._drop(conn, sel, conns)

    def _refusal(self, frame: bytes, code: Code, message: str) -> bytes:
        try:
            request_id = peek_prefix(frame)[2]
        except MessageError:
            request_id = 0
        return encode_reply(Reply(request_id, self.rank.rank, Status.ERROR, code, message=message))


# --- coordinator side ----------------------------------------------------------------------------
class _Peer:
    def __init__(self, rank: int, path: Path) -> None:
        self.rank = rank
        self.path = path
        self.sock: socket.socket | None = None
        self.reader = _FrameReader()
        self.gone = ""  # why the connection is lost for good ("" while usable)
        self.ever_connected = False


class SocketTransport:
    """Coordinator end of the local transport: ``paths[i]`` is rank ``i``'s listener.

    Connects lazily (and keeps retrying while a rank has never been reachable, so ranks may start after the
    coordinator); a connection lost after it was established marks the rank gone for good. Implements
    :class:`~elastic_kv.ranks.transport.Transport`.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        if not paths:
            raise ValueError("a SocketTransport needs at least one rank")
        self._peers = [_Peer(i, Path(p)) for i, p in enumerate(paths)]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def for_instance(
        cls, instance: str, world_size: int, directory: str | os.PathLike[str] | None = None
    ) -> SocketTransport:
        """The transport to ranks ``0..world_size-1`` of engine instance ``instance``."""
        return cls([socket_path(instance, r, directory) for r in range(world_size)])

    @property
    def world_size(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        """Close every connection; a broadcast in progress in another thread returns at once (ranks gone)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        with self._lock:
            for peer in self._peers:
                self._disconnect(peer, "transport closed")
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def broadcast(self, request: Request, timeout: float) -> list[Outcome]:
        """Send ``request`` to every rank, gather replies until ``timeout`` (see ``Transport``)."""
        with self._lock:
            if self._closed:
                return [NoReply(p.rank, "transport closed", gone=True) for p in self._peers]
            deadline = time.monotonic() + timeout
            frame = _frame(encode_request(request))
            outcomes: dict[int, Outcome] = {}
            pending: dict[socket.socket, _Peer] = {}
            for peer in self._peers:
                failure = self._send(peer, frame, deadline)
                if failure is not None:
                    outcomes[peer.rank] = failure
                else:
                    assert peer.sock is not None
                    pending[peer.sock] = peer
            self._gather(request.request_id, pending, outcomes, deadline, timeout)
            return [outcomes[p.rank] for p in self._peers]

    def _send(self, peer: _Peer, frame: bytes, deadline: float) -> NoReply | None:
        if peer.gone:
            return NoReply(peer.rank, peer.gone, gone=True)
        if peer.sock is None:
            failure = self._connect(peer, deadline)
            if failure is not None:
                return failure
        assert peer.sock is not None
        try:
            peer.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            peer.sock.sendall(frame)
        except TimeoutError:
            return NoReply(peer.rank, "timed out sending the request")
        except OSError as exc:
            self._disconnect(peer, f"connection lost: {exc}")
            return NoReply(peer.rank, peer.gone, gone=True)
        return None

    def _connect(self, peer: _Peer, deadline: float) -> NoReply | None:
        delay = 1e-3
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(os.fspath(peer.path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if peer.ever_connected:
                    peer.gone = f"listener {peer.path} is gone ({exc.strerror})"
                    return NoReply(peer.rank, peer.gone, gone=True)
                if time.monotonic() + delay >= deadline:
                    return NoReply(peer.rank, f"nothing listens on {peer.path} yet")
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
                continue
            except OSError as exc:
                sock.close()
                return NoReply(peer.rank, f"cannot connect to {peer.path}: {exc}")
            if _peer_uid(sock) != os.getuid():
                sock.close()
                peer.gone = f"{peer.path} is served by uid {_peer_uid(sock)}, not by this user"
                return NoReply(peer.rank, peer.gone, gone=True)
            peer.sock, peer.ever_connected, peer.reader = sock, True, _FrameReader()
            self._sel.register(sock, selectors.EVENT_READ, peer)
            return None

    def _disconnect(self, peer: _Peer, why: str) -> None:
        if peer.sock is not None:
            with contextlib.suppress(KeyError, ValueError, RuntimeError):
                self._sel.unregister(peer.sock)
            peer.sock.close()
            peer.sock = None
        peer.gone = peer.gone or why

    def _gather(
        self,
        request_id: int,
        pending: dict[socket.socket, _Peer],
        outcomes: dict[int, Outcome],
        deadline: float,
        timeout: float,
    ) -> None:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in self._sel.select(remaining):
                if key.fileobj is self._wake_r:
                    for peer in pending.values():
                        outcomes[peer.rank] = NoReply(peer.rank, "transport closed", gone=True)
                    pending.clear()
                    return
                peer = key.data
                if peer.sock not in pending:
                    # A late reply to an earlier, timed-out request: read and drop it below.
                    self._read(peer, request_id)
                    continue
                sock = peer.sock
                outcome = self._read(peer, request_id)
                if outcome is not None:
                    outcomes[peer.rank] = outcome
                    del pending[sock]
        for peer in pending.values():
            outcomes[peer.rank] = NoReply(peer.rank, f"no reply within {timeout:.3g}s")

    def _read(self, peer: _Peer, request_id: int) -> Outcome | None:
        """Consume what ``peer`` sent; return its outcome for ``request_id`` once known."""
        assert peer.sock is not None
        try:
            data = peer.sock.recv(_RECV_BYTES)
        except OSError as exc:
            data, why = b"", f"connection lost: {exc}"
        else:
            why = f"rank {peer.rank} closed the connection"
        if not data:
            self._disconnect(peer, why)
            return NoReply(peer.rank, peer.gone, gone=True)
        peer.reader.feed(data)
        result: Outcome | None = None
        try:
            for frame in peer.reader.frames():
                try:
                    reply = decode_reply(frame)
                except MessageError as exc:
                    result = NoReply(peer.rank, f"undecodable reply: {exc}")
                    continue
                if reply.request_id == request_id:
                    result = reply
                else:
                    logger.debug("rank %d: dropping a stale reply to request %d", peer.rank, reply.request_id)
        except MessageError as exc:
            self._disconnect(peer, f"unframeable reply stream: {exc}")
            return NoReply(peer.rank, peer.gone, gone=True)
        return result
