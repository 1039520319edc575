"""The rank side of the local transport: :class:`SocketListener` serves one rank on a Unix socket.

One thread serves one :class:`~elastic_kv.ranks.rank.Rank` on a socket ``<dir>/<instance>.r<rank>.sock``
(:mod:`.sockets`). Requests are applied one at a time in that thread, in arrival order, so there is at most
one *in-flight call*. A frame too long to resynchronise is answered MALFORMED and only that connection is
closed; the listener and its other connections stay alive.

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
import selectors
import socket
import threading
from pathlib import Path

from elastic_kv.errors import ConfigError
from elastic_kv.ranks.messages import Code, MessageError, Reply, Status, encode_reply, peek_prefix
from elastic_kv.ranks.rank import Rank
from elastic_kv.ranks.sockets import RECV_BYTES, FrameReader, encode_frame, peer_uid

__all__ = ["SocketListener"]

logger = logging.getLogger(__name__)


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
        conns: dict[socket.socket, FrameReader] = {}
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

    def _accept(self, sel: selectors.BaseSelector, conns: dict[socket.socket, FrameReader]) -> None:
        try:
            conn, _ = self._lsock.accept()
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.ECONNABORTED, errno.EINTR):
                return
            sel.unregister(self._lsock)  # shut down (EINVAL): accept no more
            return
        if peer_uid(conn) != os.getuid():
            logger.warning("listener %s: refused a connection from uid %d", self.path, peer_uid(conn))
            conn.close()
            return
        conn.settimeout(self._send_timeout)
        conns[conn] = FrameReader()
        sel.register(conn, selectors.EVENT_READ, None)

    def _drop(
        self, conn: socket.socket, sel: selectors.BaseSelector, conns: dict[socket.socket, FrameReader]
    ) -> None:
        sel.unregister(conn)
        del conns[conn]
        conn.close()

    def _read(
        self, conn: socket.socket, sel: selectors.BaseSelector, conns: dict[socket.socket, FrameReader]
    ) -> None:
        try:
            data = conn.recv(RECV_BYTES)
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
                conn.sendall(encode_frame(reply))
        except MessageError as exc:  # unframeable stream: answer once, then drop only this connection
            logger.warning("listener %s: %s; closing that connection", self.path, exc)
            with contextlib.suppress(OSError):
                conn.sendall(encode_frame(self._refusal(b"", Code.MALFORMED, str(exc))))
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
