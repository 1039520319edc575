"""Where the registry lives, how its files are created and locked, and how a dead owner is recognised.

Directory. One per user: ``$ELASTIC_KV_REGISTRY_DIR`` if set, else ``/dev/shm/elastic-kv-<euid>`` (tmpfs, so
the files *are* shared memory). Not ``$XDG_RUNTIME_DIR``: it differs between a login shell, a systemd
service and a container, and is removed at logout, so ``kvctl`` and the engines could silently disagree on
where to meet. The directory is created 0700; one that is a symlink, is owned by another user or is open
to group/others is refused (another user could otherwise plant records or read ours).

Names. A file is named after what it describes -- ``<pool>.pool``, ``<device>.device`` -- never after a
process or process group: kvcached derived its segment name from the PGID, which is 1 for every
container's main process, so two containers sharing /dev/shm overwrote and unlinked each other's segment.
A new file is written under a temporary name and published with ``link()``, which fails instead of
replacing an existing file, so a visible file is always complete and two creators cannot both win.

Liveness. The owner of a pool record holds an exclusive ``flock`` on it for its whole life; the kernel
drops it when the process dies, however it dies (SIGKILL included), and it works across PID namespaces
(containers sharing /dev/shm). A forked child inherits the lock, so when the owner's PID is visible
(same PID namespace) the record is also dead if that PID is gone, a zombie, or a different process (the
start time in ``/proc/<pid>/stat`` changed: PID reuse).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from elastic_kv.errors import ConfigError

__all__ = [
    "ENV_REGISTRY_DIR",
    "ProcessIdentity",
    "RegistryConfig",
    "check_device_name",
    "check_pool_name",
    "create_file",
    "ensure_private_directory",
    "exclusive_lock",
    "file_lock_is_free",
    "open_existing",
    "owner_is_dead",
    "pid_namespace",
    "process_start_ticks",
    "registry_lock",
    "remove_stale_temporaries",
]

ENV_REGISTRY_DIR = "ELASTIC_KV_REGISTRY_DIR"

_REGISTRY_LOCK_NAME = ".lock"
_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
# A temporary file younger than this may belong to a creator that has not locked it yet.
_TEMPORARY_GRACE_S = 10.0


def _check_name(value: str, kind: str, pattern: re.Pattern[str], rule: str) -> str:
    """Return ``value`` if ``pattern`` matches all of it, else raise ``ValueError`` naming the ``kind`` of
    name and the ``rule`` it breaks."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"invalid {kind} name {value!r}: use 1-64 characters from {rule}")
    return value


def check_pool_name(name: str) -> str:
    """Return ``name`` if it can name a pool (it becomes a file name), else raise ``ValueError``."""
    return _check_name(
        name, "pool", _POOL_NAME, "A-Z a-z 0-9 . _ - , starting with a letter or digit (e.g. 'vllm-qwen3-8b')"
    )


def check_device_name(device: str) -> str:
    """Return ``device`` if it can name a device (``cuda:0``, a GPU UUID), else raise ``ValueError``."""
    return _check_name(
        device, "device", _DEVICE_NAME, "A-Z a-z 0-9 . _ : - (e.g. 'cuda:0' or the GPU's UUID)"
    )


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """Where this process's registry lives. Build it once (``from_env``) and pass it down."""

    directory: Path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RegistryConfig:
        """The directory of :class:`ElasticConfig` (``ELASTIC_KV_REGISTRY_DIR``), else the default.

        The default is ``/dev/shm/elastic-kv-<euid>``, or the system temporary directory where ``/dev/shm``
        does not exist. Only ``ELASTIC_KV_REGISTRY_DIR`` is read, through :meth:`ElasticConfig.from_env`
        (the one place that parses the environment), when called -- never at import time; a bad value of
        another ``ELASTIC_KV_*`` variable concerns the engines, not the registry.
        """
        from elastic_kv.config import ElasticConfig

        source = os.environ if environ is None else environ
        # Only the one variable this needs: kvctl must work whatever the engines' other settings say.
        own = {ENV_REGISTRY_DIR: source[ENV_REGISTRY_DIR]} if ENV_REGISTRY_DIR in source else {}
        explicit = ElasticConfig.from_env(own).registry_dir
        return cls(explicit) if explicit is not None else cls.default()

    @classmethod
    def default(cls) -> RegistryConfig:
        """``/dev/shm/elastic-kv-<euid>`` (or under the temporary directory where there is no /dev/shm)."""
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        return cls(base / f"elastic-kv-{os.geteuid()}")

    @property
    def lock_path(self) -> Path:
        """The directory-wide lock that serialises creating and reclaiming records."""
        return self.directory / _REGISTRY_LOCK_NAME


def ensure_private_directory(path: Path) -> Path:
    """Create ``path`` (mode 0700) if missing and check that it is a private directory of this user.

    Raises :class:`ConfigError`, naming the fix, if the path is not a directory (or is a symlink), belongs
    to another user, or grants any permission to group or others. The parent must already exist.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError as exc:
        raise ConfigError(f"registry directory {path}: parent {path.parent} does not exist") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"registry directory {path} is not a directory (symlinks are refused); remove it or set "
            f"{ENV_REGISTRY_DIR} to another path"
        )
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"registry directory {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
            f"refusing to share it. Set {ENV_REGISTRY_DIR} to a directory of your own"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"registry directory {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be private "
            f"(run: chmod 700 {path})"
        )
    return path


def create_file(directory: Path, name: str, content: bytes, *, keep_locked: bool) -> int | None:
    """Atomically create ``directory/name`` (mode 0600) with ``content``; ``None`` if the name exists.

    The file is written under a temporary name and then ``link()``-ed into place, so no reader ever sees
    a partial file and of two concurrent creators exactly one succeeds. With ``keep_locked`` the returned
    descriptor holds an exclusive ``flock`` (the owner-liveness lock), taken *before* the file becomes
    visible. Otherwise the descriptor is returned unlocked. The caller owns the descriptor.
    """
    tmp = directory / f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    published = False
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but an odd umask could narrow it below 0600
        # Locked while it is a temporary too, so remove_stale_temporaries never takes a live creator's file.
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, content, 0)
        try:
            os.link(tmp, directory / name)
        except FileExistsError:
            return None
        published = True
        return fd
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if not published:
            os.close(fd)
        elif not keep_locked:
            fcntl.flock(fd, fcntl.LOCK_UN)


def remove_stale_temporaries(directory: Path) -> int:
    """Remove temporary files that creators died with (unlocked, older than a grace period); count them."""
    removed = 0
    now = time.time()
    for path in directory.glob(".*.tmp"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime > _TEMPORARY_GRACE_S and file_lock_is_free(fd):
                os.unlink(path)
                removed += 1
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def registry_lock(config: RegistryConfig) -> Iterator[None]:
    """Hold the directory-wide lock: creating, closing and reclaiming records happen under it.

    It orders a creator that replaces a dead record against a reclaimer removing that same dead record
    (without it, the reclaimer could unlink the new record). The per-device lock nests inside it.
    """
    fd = os.open(config.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with exclusive_lock(fd):
            yield
    finally:
        os.close(fd)


def open_existing(path: Path, min_size: int) -> int | None:
    """Open a registry file read-write; ``None`` if it vanished. ``ConfigError`` if it is not ours or short.

    A file that is too short (another release, or corruption) is reported rather than mapped: mapping it
    and touching a field past its end would raise SIGBUS.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"registry file {path} is a symlink; refusing it") from exc
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode) or st.st_size < min_size:
        os.close(fd)
        raise ConfigError(
            f"registry file {path} is not a registry file of this user and version "
            f"(uid {st.st_uid}, {st.st_size} bytes); remove it"
        )
    return fd


@contextlib.contextmanager
def exclusive_lock(fd: int) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``fd`` for the ``with`` block.

    ``flock`` locks belong to the open file description, not the process (unlike POSIX ``fcntl`` locks,
    which any ``close()`` of the same file in the process would silently drop), and the kernel releases
    them when the holder dies. Threads sharing one descriptor are *not* excluded: callers add a thread
    lock where several threads use one descriptor.
    """
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def file_lock_is_free(fd: int) -> bool:
    """Whether no one holds a ``flock`` on the file of ``fd`` (a record's owner always does).

    Probes with a non-blocking shared lock and releases it at once.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A process as the registry stores it: PID, start time and PID namespace."""

    pid: int
    start_ticks: int  # clock ticks after boot when the process started; with the PID, unique on a host
    pid_namespace: int  # inode of /proc/<pid>/ns/pid; PIDs compare only within one namespace

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process."""
        pid = os.getpid()
        return cls(pid, process_start_ticks(pid) or 0, pid_namespace())


def pid_namespace() -> int:
    """Inode number of this process's PID namespace (0 where /proc does not show it)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot; ``None`` if no such process or it is a zombie."""
    # os.open/os.read rather than open(): a third of the cost, and this runs once per live pool whenever a
    # charge is refused.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        data = os.read(fd, 4096)
    except ProcessLookupError:  # the process exited between open and read
        return None
    finally:
        os.close(fd)
    if not data:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields after it follow the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # field 3, state: zombie or dead
        return None
    return int(fields[19])  # field 22, starttime


def owner_is_dead(pid: int, start_ticks: int, owner_namespace: int, my_namespace: int) -> bool:
    """Whether the PID check alone proves the owner is gone.

    Only meaningful in the owner's own PID namespace; elsewhere it answers False (unknown), and the
    caller relies on the record lock.
    """
    if owner_namespace == 0 or owner_namespace != my_namespace:
        return False
    return process_start_ticks(pid) != start_ticks
