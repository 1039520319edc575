"""The coordinator side of the local transport: :class:`SocketTransport`, Unix sockets between processes
of one host that share no engine channel.

One persistent connection per rank (kvcached opened a connection per message); a broadcast writes the
request to every rank first, then gathers the replies with one selector, so the ranks work in parallel.
Each rank is served by a :class:`~elastic_kv.ranks.listener.SocketListener`; names, safety and framing are
:mod:`.sockets`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from elastic_kv.ranks.messages import MessageError, Request, decode_reply, encode_request
from elastic_kv.ranks.sockets import RECV_BYTES, FrameReader, encode_frame, peer_uid, socket_path
from elastic_kv.ranks.transport import NoReply, Outcome

__all__ = ["SocketTransport"]

logger = logging.getLogger(__name__)


class _Peer:
    def __init__(self, rank: int, path: Path) -> None:
        self.rank = rank
        self.path = path
        self.sock: socket.socket | None = None
        self.reader = FrameReader()
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
            frame = encode_frame(encode_request(request))
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
            if peer_uid(sock) != os.getuid():
                sock.close()
                peer.gone = f"{peer.path} is served by uid {peer_uid(sock)}, not by this user"
                return NoReply(peer.rank, peer.gone, gone=True)
            peer.sock, peer.ever_connected, peer.reader = sock, True, FrameReader()
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
            data = peer.sock.recv(RECV_BYTES)
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
