"""Results computed once per cache file, across processes.

The native references of the engine tests are cached as JSON under ``.cache/``. Several processes can need
the same one at the same time (the workers of ``pytest -n 2``, or two runs of one checkout): the first one
computes it while holding a lock beside the file, the others wait for that lock and read what it wrote.
A lock is an ``flock``, so a process that dies releases it; a result is written to a temporary file and
renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the lock of cache file ``path`` (waiting for whoever holds it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(_lock_path(path), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def try_lock(path: Path) -> Any | None:
    """The lock of cache file ``path`` if nobody holds it (an open file: closing it releases the lock),
    else ``None``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(_lock_path(path), "w")  # noqa: SIM115 -- returned to the caller, who closes it
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` as JSON, all at once for any reader."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def json_once(path: Path, compute: Callable[[], Any]) -> Any:
    """The JSON value cached in ``path``; when there is none, ``compute()``'s, written there first. Of
    concurrent callers for one ``path``, one computes and the others read its result."""
    if path.exists():
        return read_json(path)
    with locked(path):
        if path.exists():
            return read_json(path)
        value = compute()
        write_json(path, value)
        return value
