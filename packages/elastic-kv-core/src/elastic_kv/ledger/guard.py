"""Which thread drives a pool, and whether the pool may still be used: :class:`PoolGuard`.

A pool has one owner thread, the engine's scheduling thread. Every method that changes the pool makes
one comparison, ``get_ident() != guard.owner``, which checks both "right thread" and "pool usable":
``owner`` is the owner thread's ident while the pool is usable and -1 once it is closed or inconsistent.
Only when the comparison fails does :meth:`PoolGuard.refuse` find out which, and raise accordingly.
That is far cheaper than a lock on a path that runs per scheduled request.
"""

from __future__ import annotations

import logging
from threading import get_ident
from typing import NoReturn

from elastic_kv.errors import StateConsistencyError

__all__ = ["PoolGuard"]

logger = logging.getLogger("elastic_kv.ledger")


class PoolGuard:
    """The owner thread and the health (open, closed, inconsistent) of the pool ``name``.

    ``owner`` is read on every hot path; the other attributes say why it is -1. The thread that builds
    the guard owns the pool until :meth:`bind_thread` moves it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread = get_ident()
        self.owner = self.thread
        self.broken: str | None = None  # why the pool is inconsistent
        self.closed = False

    def refuse(self) -> None:
        """Raise why the calling thread may not change the pool now: ``RuntimeError`` (another thread),
        ``ValueError`` (closed) or :class:`StateConsistencyError` (inconsistent)."""
        self.check_thread()
        if self.closed:
            raise ValueError(f"pool {self.name} is closed")
        if self.broken is not None:
            raise StateConsistencyError(f"pool {self.name} is inconsistent: {self.broken}")

    def check_thread(self) -> None:
        """``RuntimeError`` unless the calling thread owns the pool (closed or not)."""
        if get_ident() != self.thread:
            raise RuntimeError(
                f"pool {self.name} is driven by thread {self.thread}, not {get_ident()}: call "
                f"bind_thread() on the thread that drives it (a pool is not shared between threads)"
            )

    def bind_thread(self) -> None:
        """Make the calling thread the pool's owner."""
        self.thread = get_ident()
        if not self.closed and self.broken is None:
            self.owner = self.thread

    def fail(self, message: str) -> NoReturn:
        """The ledger and the data plane disagree: mark the pool inconsistent (it refuses all further
        work) and raise :class:`StateConsistencyError`."""
        self.broken = message
        self.owner = -1
        logger.error("pool %s is inconsistent: %s", self.name, message)
        raise StateConsistencyError(f"pool {self.name}: {message}")

    def close(self) -> None:
        """The pool is closed: it refuses all further work."""
        self.closed = True
        self.owner = -1
