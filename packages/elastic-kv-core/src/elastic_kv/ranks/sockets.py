"""Where the ranks' Unix sockets live, what they are named, and how messages are framed on them.

Safety (kvcached's sockets live in ``/tmp`` with the default umask and unpickle what they read): the
directory is per user, created ``0700`` and refused if it is anyone else's or open to others; sockets are
``0600``; both ends check the peer's uid (``SO_PEERCRED``); a message is parsed, never executed; names carry
an engine-instance token so that two engines of one user never meet.

Framing: a ``u32`` little-endian length, then one message. A frame that is too long cannot be resynchronised:
the listener answers MALFORMED and closes that connection, keeping the others and itself alive.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

from elastic_kv.errors import ConfigError
from elastic_kv.ranks.messages import MAX_MESSAGE_BYTES, MessageError

__all__ = ["FrameReader", "encode_frame", "new_instance_name", "peer_uid", "socket_dir", "socket_path"]

_LEN = struct.Struct("<I")
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_SO_PEERCRED = struct.Struct("3i")
RECV_BYTES = 1 << 16  # what one recv() asks for


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


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _SO_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


def encode_frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


class FrameReader:
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
