"""A :class:`~elastic_kv.ranks.Coordinator` as the ledger's asynchronous page mapper, releasing behind.

:class:`CoordinatorMapper` is the :class:`~elastic_kv.ledger.page_mapper.AsyncPageMapper` a ledger drives
when its pages live in other threads or processes (an engine's workers). One background thread carries
out, in order:

* ``map_async`` jobs -- the ledger's pre-mapping of its reserve, collected with ``collect()``;
* **releases** -- ``unmap`` queues the release and returns at once ("release-behind"). The ledger has
  decided that nobody uses the pages any more (its epochs waited for the device work that could read
  them), so only the driver's work is left, and the engine's step need not wait for it: at an engine's
  transition to idle that is hundreds of unmaps, which would otherwise delay the step's last outputs.

Ordering keeps the data plane consistent with the ledger's view: jobs run first in, first out, and a
synchronous ``map`` first waits for every release queued before it (the ledger reuses the most recently
released pages first, and the memory they return may be what the map needs). The ledger returns a
released page's charge at once, so for the few milliseconds until the release is done the shared budget
counts memory as free that the driver still holds: another pool that maps into it in that window may get a
driver out-of-memory, which it treats as pressure (it retries), never as an error.

A release that fails is retried (the coordinator rolled it back: the pages are still backed on every rank).
If it still fails, the ledger's view is wrong, and the pool must stop: every later ``map`` / ``unmap``
raises :class:`~elastic_kv.errors.StateConsistencyError` and every later background map reports it, which
the ledger turns into its inconsistent state.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence

from elastic_kv.errors import StateConsistencyError
from elastic_kv.ledger.page_mapper import MapResult, PageMapper
from elastic_kv.ranks.coordinator import _short

__all__ = ["CoordinatorMapper"]

logger = logging.getLogger(__name__)

_RELEASE = 0  # the job id of releases (map jobs count from 1)
# Pauses before the second and third attempt of a failed release (a rank busy or slow to answer).
_RELEASE_RETRY_S = (0.05, 0.5)


class CoordinatorMapper:
    """See the module docstring. ``inner`` is the coordinator (any synchronous ``PageMapper``).

    ``calls`` counts the synchronous maps: each made the calling thread (an engine's scheduler) wait for
    the ranks' driver; ``waits`` the ``collect(wait=True)`` calls that had to wait for a background map
    still queued or running. ``async_jobs`` counts background maps, ``releases`` queued releases.
    """

    def __init__(self, inner: PageMapper, *, name: str = "elastic-kv-mapper") -> None:
        self.inner = inner
        self.calls = 0
        self.waits = 0
        self.async_jobs = 0
        self.releases = 0
        self._outstanding = 0  # map jobs queued and not yet collected
        self._jobs: queue.SimpleQueue[tuple[int, list[int]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[MapResult] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._released = 0  # releases carried out (or given up), by the background thread
        self._failure: str | None = None  # why a release failed for good
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # -- the caller's thread -----------------------------------------------------------------------------
    def map(self, pages: Sequence[int]) -> None:
        """Back ``pages`` on every rank now, after the releases queued so far (see the module docstring)."""
        if self._released != self.releases:
            self.flush()
        self._check()
        self.calls += 1
        self.inner.map(pages)

    def unmap(self, pages: Sequence[int]) -> None:
        """Queue the release of ``pages`` on the background thread and return at once."""
        self._check()
        self.releases += 1
        self._jobs.put((_RELEASE, list(pages)))

    def map_async(self, pages: Sequence[int]) -> int:
        """Queue an all-or-nothing map of ``pages`` on the background thread; returns the job id."""
        job = next(self._ids)
        self.async_jobs += 1
        self._outstanding += 1
        self._jobs.put((job, list(pages)))
        return job

    def collect(self, wait: bool = False, jobs: int = 0) -> list[MapResult]:
        """Map jobs finished since the last call, ``(job, pages, None | error text)``; never blocks unless
        ``wait``, which first waits for every queued job, or with ``jobs > 0`` for the ``jobs`` oldest
        (jobs finish in the order they were queued)."""
        out: list[MapResult] = []
        waited = False
        while self._outstanding:
            block = wait and (jobs <= 0 or len(out) < jobs)
            waited = waited or (block and self._done.empty())
            try:
                out.append(self._done.get(block=block))
            except queue.Empty:
                break
            self._outstanding -= 1
        self.waits += waited
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every release queued so far has been carried out (or given up); False on timeout.
        Engines call it where the memory must be free when they return (sleep)."""
        target = self.releases
        with self._cond:
            return self._cond.wait_for(lambda: self._released >= target, timeout)

    @property
    def pending_releases(self) -> int:
        """Releases queued and not yet carried out."""
        return self.releases - self._released

    def _check(self) -> None:
        if self._failure is not None:
            raise StateConsistencyError(self._failure)

    def close(self) -> None:
        """Stop the background thread. Jobs still queued are dropped (map jobs report ``Cancelled``): an
        engine closes its mapper after its ranks are gone, and with them every page."""
        self._closing = True
        self._jobs.put(None)
        self._thread.join(timeout=5.0)

    # -- the background thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, pages = item
            if job == _RELEASE:
                self._release(pages)
            elif self._closing:
                self._done.put((job, pages, "Cancelled: the mapper is closing"))
            elif self._failure is not None:
                self._done.put((job, pages, f"StateConsistencyError: {self._failure}"))
            else:
                try:
                    self.inner.map(pages)
                    self._done.put((job, pages, None))
                except Exception as exc:  # reported to the ledger, which undoes the job
                    self._done.put((job, pages, f"{type(exc).__name__}: {exc}"))

    def _release(self, pages: list[int]) -> None:
        failure = None
        if not self._closing and self._failure is None:
            for pause in (*_RELEASE_RETRY_S, None):
                try:
                    self.inner.unmap(pages)
                    failure = None
                    break
                except StateConsistencyError as exc:
                    failure = str(exc)
                    break
                except Exception as exc:  # rolled back on every rank: the pages are still backed
                    failure = f"{type(exc).__name__}: {exc}"
                    if pause is None or self._closing:
                        break
                    logger.warning("release of pages %s failed, retrying: %s", _short(pages), failure)
                    time.sleep(pause)
        with self._cond:
            if failure is not None and self._failure is None:
                self._failure = f"release of pages {_short(pages)} failed: {failure}"
                logger.error("%s", self._failure)
            self._released += 1
            self._cond.notify_all()
