"""Rank side of the ranks protocol: the state machine that applies a coordinator's requests to one process's
``SpaceGroup``\\ s.

One file over 400 lines on purpose: one state machine, whose transitions must read in one place.

Every request names a transaction ``tx`` (ids only grow per pool). The rank remembers the outcome of recent
transactions in a bounded history, which is what makes the protocol safe against duplicate, late and lost
messages:

* a duplicate of a request already carried out gets the same answer and changes nothing;
* ROLLBACK/ABORT of a transaction the rank never saw records a *tombstone*, so that the request, if it arrives
  late, is refused instead of applied after the coordinator gave up on it;
* a request for a transaction older than every id the rank has seen, and not in its history, is refused (it
  is a late message whose outcome was already decided, or forgotten).

Transaction states (``_TxState``)::

    MAP:     MAPPED ---ROLLBACK---> ROLLED_BACK          MAP_FAILED --ROLLBACK--> ROLLED_BACK
    UNMAP:   PREPARED ---COMMIT---> COMMITTED           PREPARED ---ABORT---> ABORTED
             QUEUED --epoch--> PREPARED                 QUEUED ---ABORT---> ABORTED (nothing to restore)
             QUEUED ---COMMIT---> COMMIT_QUEUED --epoch--> COMMITTED
             PREPARE_FAILED ---ABORT---> ABORTED

A PREPARE tagged with an epoch that has not finished on this rank is validated at once and QUEUED; it is
applied when the rank's :class:`~elastic_kv.ranks.fence.EpochFence` reaches the epoch (checked before every
request, and on :meth:`Rank.finish_epoch` / :meth:`Rank.poll`). Its pages are *retiring*: still backed, no
longer the pool's. A MAP of a retiring page waits (bounded) for its epoch, else answers BUSY.

A failure that leaves the rank's pages in doubt (the data plane's ``StateConsistencyError``, an unexpected
exception, a queued unmap that fails when applied) marks the pool inconsistent: every later request but
STATUS/SYNC is answered INCONSISTENT, so the coordinator stops the whole pool instead of diverging.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from elastic_kv.errors import PoolExhausted, StateConsistencyError
from elastic_kv.ranks.fence import Completion, EpochFence
from elastic_kv.ranks.messages import (
    NO_EPOCH,
    Code,
    MessageError,
    Op,
    RankInfo,
    Reply,
    Request,
    Status,
    decode_request,
    encode_reply,
    peek_prefix,
)

try:
    from elastic_kv._vmm import BackendError
except ImportError:  # a data plane that is not ours: its untyped errors are treated as unknown state
    BackendError = None  # type: ignore[assignment,misc]

__all__ = ["Rank", "RankTarget"]

logger = logging.getLogger(__name__)


class RankTarget(Protocol):
    """What a rank drives: the subset of ``elastic_kv._vmm.SpaceGroup`` the protocol needs."""

    @property
    def num_pages(self) -> int: ...
    @property
    def num_mapped(self) -> int: ...
    @property
    def mapped_bytes(self) -> int: ...
    @property
    def consistent(self) -> bool: ...
    @property
    def error(self) -> str: ...
    def map(self, pages: Sequence[int]) -> None: ...
    def prepare(self, tx: int, pages: Sequence[int]) -> None: ...
    def commit(self, tx: int) -> None: ...
    def abort(self, tx: int) -> None: ...
    def is_mapped(self, page: int) -> bool: ...
    def mapped_pages(self) -> list[int]: ...


class _TxState(enum.Enum):
    MAPPED = "mapped"
    MAP_FAILED = "map_failed"
    ROLLED_BACK = "rolled_back"
    QUEUED = "queued"
    COMMIT_QUEUED = "commit_queued"
    PREPARED = "prepared"
    PREPARE_FAILED = "prepare_failed"
    COMMITTED = "committed"
    ABORTED = "aborted"


_MAX_TX = 1 << 63  # the data plane's transaction ids are int64
_MAP_STATES = {_TxState.MAPPED, _TxState.MAP_FAILED, _TxState.ROLLED_BACK}
_ACTIVE_STATES = {_TxState.QUEUED, _TxState.COMMIT_QUEUED, _TxState.PREPARED}


@dataclass(slots=True)
class _Tx:
    state: _TxState
    pages: tuple[int, ...] = ()
    epoch: int = NO_EPOCH


class _Failed(Exception):
    """Internal: answer the current request with an ERROR reply of this code."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code


class _PoolRank:
    """Per-pool rank state: the target, the transaction history and the unmaps queued behind epochs."""

    def __init__(self, target: RankTarget, backend: Any, handle_pool: Any, history: int) -> None:
        self.target = target
        self.backend = backend
        self.handle_pool = handle_pool
        self.history_limit = history
        self.history: collections.OrderedDict[int, _Tx] = collections.OrderedDict()
        self.queued: dict[int, _Tx] = {}  # tx -> QUEUED/COMMIT_QUEUED record, in arrival order
        self.retiring: dict[int, int] = {}  # page -> tx of the queued unmap that will unmap it
        self.last_tx = 0
        self.broken = ""  # set when this layer, not the data plane, lost track of the pages

    # --- consistency -------------------------------------------------------------------------
    def error(self) -> str:
        if self.broken:
            return self.broken
        if not self.target.consistent:
            return self.target.error or "the data plane marked the pool inconsistent"
        return ""

    def break_(self, why: str) -> _Failed:
        if not self.broken:
            self.broken = why
            logger.error("rank pool marked inconsistent: %s", why)
        return _Failed(Code.INCONSISTENT, why)

    @contextlib.contextmanager
    def break_on_failure(self, what: str) -> Iterator[None]:
        """Run a data-plane step that the coordinator's decision already counts on (a commit, an abort, a
        rollback's undo): if it raises, this layer no longer knows which pages are mapped, so the pool
        breaks and the step's request is answered INCONSISTENT."""
        try:
            yield
        except Exception as exc:
            raise self.break_(f"{what} failed: {exc!r}") from None

    # --- history -----------------------------------------------------------------------------
    def remember(self, tx: int, record: _Tx) -> None:
        self.history[tx] = record
        self.history.move_to_end(tx)
        self.last_tx = max(self.last_tx, tx)
        # Evict the oldest finished record; active ones (queued, prepared) are never forgotten. The oldest is
        # almost always finished, so this is O(1) per request.
        while len(self.history) > self.history_limit:
            oldest = next((t for t, r in self.history.items() if r.state not in _ACTIVE_STATES), None)
            if oldest is None:
                break
            del self.history[oldest]

    def lookup(self, tx: int, op: Op) -> _Tx | None:
        """The record of ``tx``; None for a new transaction; _Failed for a stale unknown one."""
        if not 0 < tx < _MAX_TX:
            raise _Failed(Code.BAD_ARGUMENT, f"transaction id {tx} is outside [1, 2**63)")
        record = self.history.get(tx)
        if record is None and tx <= self.last_tx:
            raise _Failed(
                Code.REFUSED,
                f"{op.name} of tx {tx}: older than the newest tx {self.last_tx} and not in the history "
                "(a late message; its outcome was decided without it)",
            )
        return record

    # --- epoch-queued unmaps -----------------------------------------------------------------
    def drain(self, fence: EpochFence) -> None:
        """Apply every queued unmap whose epoch has finished, oldest first."""
        for tx, record in list(self.queued.items()):
            if not fence.reached(record.epoch):
                continue
            del self.queued[tx]
            for page in record.pages:
                self.retiring.pop(page, None)
            try:
                self.target.prepare(tx, record.pages)
                if record.state is _TxState.COMMIT_QUEUED:
                    self.target.commit(tx)
                    record.state = _TxState.COMMITTED
                else:
                    record.state = _TxState.PREPARED
            except Exception as exc:  # the coordinator was told this unmap would happen: pages diverge
                record.state = _TxState.PREPARE_FAILED
                self.break_(
                    f"queued unmap tx {tx} of pages {list(record.pages)} failed when applied: {exc!r}"
                )

    def info(self, fence: EpochFence) -> RankInfo:
        target = self.target
        return RankInfo(
            pid=os.getpid(),
            num_pages=target.num_pages,
            num_mapped=target.num_mapped,
            queued_unmaps=len(self.queued),
            consistent=not self.error(),
            live_handles=int(getattr(self.backend, "live_handles", 0)),
            cached_handles=int(getattr(self.handle_pool, "cached_handles", 0)),
            mapped_bytes=target.mapped_bytes,
            finished_epoch=fence.finished,
            last_tx=self.last_tx,
        )


def _data_plane_failure(pool: _PoolRank, what: str, exc: Exception) -> _Failed:
    """Translate a data-plane exception; anything but a typed, state-preserving error breaks the pool."""
    if isinstance(exc, PoolExhausted):
        return _Failed(Code.EXHAUSTED, f"{what}: {exc}")
    if isinstance(exc, StateConsistencyError):
        return pool.break_(f"{what}: {exc}")
    if isinstance(exc, (ValueError, TypeError, OverflowError)):  # refused before any state changed
        return _Failed(Code.BAD_ARGUMENT, f"{what}: {exc}")
    if BackendError is not None and isinstance(exc, BackendError):  # rolled back by the data plane
        return _Failed(Code.BACKEND, f"{what}: {exc}")
    return pool.break_(f"{what}: unexpected {exc!r}")


class Rank:
    """One process's endpoint of the ranks protocol; serves one or more pools (``SpaceGroup``\\ s).

    ``dispatch`` (objects, used in-process) and ``handle`` (bytes, used by every other transport) never raise:
    every failure becomes an ERROR reply. Requests are applied one at a time (a lock), so any number of
    transports may feed the same rank. ``rank`` is this process's index among all ranks of all pipeline stages
    (stage-major: ``pp_stage * tp_size + tp_rank``); the coordinator checks it against the reply order.
    """

    def __init__(self, rank: int, *, history: int = 4096, busy_wait: float = 1.0) -> None:
        """``history``: transaction outcomes kept per pool (>= 16). ``busy_wait``: seconds a MAP waits for a
        retiring page's epoch before answering BUSY."""
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if history < 16:
            raise ValueError(f"history must be >= 16, got {history}")
        self.rank = rank
        self.fence = EpochFence()
        self._history = history
        self.busy_wait = busy_wait
        self._pools: dict[int, _PoolRank] = {}
        self._lock = threading.Lock()
        self._handlers: dict[Op, Callable[[_PoolRank, Request], Status]] = {
            Op.MAP: self._map,
            Op.ROLLBACK: self._rollback,
            Op.PREPARE: self._prepare,
            Op.COMMIT: self._commit,
            Op.ABORT: self._abort,
        }

    def add_pool(
        self, target: RankTarget, *, pool: int = 0, backend: Any = None, handle_pool: Any = None
    ) -> None:
        """Serve ``target`` as pool ``pool``. ``backend`` and ``handle_pool`` (optional) feed the handle
        counts of STATUS replies."""
        with self._lock:
            if pool in self._pools:
                raise ValueError(f"pool {pool} is already served by rank {self.rank}")
            self._pools[pool] = _PoolRank(target, backend, handle_pool, self._history)

    def remove_pool(self, pool: int) -> None:
        """Stop serving ``pool`` and drop this rank's references to its target (KeyError when not served).
        Later requests for it are answered UNKNOWN_POOL. Used to rebuild a pool after the consistency-error
        state."""
        with self._lock:
            del self._pools[pool]

    # --- engine-facing -------------------------------------------------------------------------
    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold every request off (they wait) while the engine changes its targets' pages beside the
        protocol, e.g. moves their contents to host memory and back, keeping what it answers for them
        consistent."""
        with self._lock:
            yield

    def finish_epoch(self, epoch: int) -> None:
        """The engine declares device work through ``epoch`` finished; queued unmaps now due are applied."""
        self.fence.finish(epoch)
        self.poll()

    def record_epoch(self, epoch: int, completion: Completion) -> None:
        """The engine registers the completion (e.g. a CUDA event) that ends ``epoch``'s device work."""
        self.fence.record(epoch, completion)

    def poll(self) -> None:
        """Apply queued unmaps whose epoch has finished (cheap when nothing is due)."""
        with self._lock:
            for pool in self._pools.values():
                if pool.queued:
                    pool.drain(self.fence)

    def interrupt(self) -> None:
        """Wake a request blocked on the epoch fence (listener shutdown); later waits fail at once (BUSY)."""
        self.fence.interrupt()

    def info(self, pool: int = 0) -> RankInfo:
        """This rank's view of ``pool`` (KeyError when not served)."""
        with self._lock:
            return self._pools[pool].info(self.fence)

    # --- protocol-facing -----------------------------------------------------------------------
    def handle(self, data: bytes | memoryview) -> bytes:
        """Decode a request, apply it, return the encoded reply. Never raises; malformed input gets
        a MALFORMED (or VERSION / UNKNOWN_OP) reply."""
        try:
            request = decode_request(data)
        except MessageError as exc:
            request_id = exc.request_id
            if not request_id:
                try:
                    request_id = peek_prefix(data)[2]
                except MessageError:
                    request_id = 0
            logger.warning("rank %d: rejected a malformed request: %s", self.rank, exc)
            return encode_reply(Reply(request_id, self.rank, Status.ERROR, exc.code, message=str(exc)))
        return encode_reply(self.dispatch(request))

    def dispatch(self, req: Request) -> Reply:
        """Apply one request and return this rank's reply. Never raises."""
        with self._lock:
            try:
                return self._dispatch(req)
            except _Failed as failed:
                return Reply(req.request_id, self.rank, Status.ERROR, failed.code, req.pool, str(failed))
            except Exception as exc:  # a bug in this layer: report it, keep serving
                logger.exception("rank %d: %s of tx %d failed unexpectedly", self.rank, req.op.name, req.tx)
                return Reply(req.request_id, self.rank, Status.ERROR, Code.INTERNAL, req.pool, repr(exc))

    def _dispatch(self, req: Request) -> Reply:
        pool = self._pools.get(req.pool)
        if pool is None:
            raise _Failed(Code.UNKNOWN_POOL, f"rank {self.rank} serves no pool {req.pool}")
        if req.finished_epoch > self.fence.finished:
            self.fence.finish(req.finished_epoch)
        if pool.queued:
            pool.drain(self.fence)
        if req.op is Op.STATUS:
            # The pool's view: retiring pages are still backed here but no longer the pool's.
            live = tuple(sorted(p for p in pool.target.mapped_pages() if p not in pool.retiring))
            return Reply(
                req.request_id, self.rank, Status.OK, Code.NONE, req.pool, "", live, pool.info(self.fence)
            )
        if req.op is Op.SYNC:
            return Reply(
                req.request_id, self.rank, Status.OK, Code.NONE, req.pool, "", (), pool.info(self.fence)
            )
        if error := pool.error():
            raise _Failed(Code.INCONSISTENT, f"rank {self.rank} pool {req.pool} is inconsistent: {error}")
        status = self._handlers[req.op](pool, req)
        return Reply(req.request_id, self.rank, status, Code.NONE, req.pool)

    # --- handlers: each returns the reply status or raises _Failed -----------------------------
    def _map(self, pool: _PoolRank, req: Request) -> Status:
        record = pool.lookup(req.tx, req.op)
        if record is not None:
            if record.state is _TxState.MAPPED and record.pages == req.pages:
                return Status.OK  # a duplicate
            raise _Failed(Code.REFUSED, f"MAP of tx {req.tx} refused: the tx is {record.state.value}")
        try:
            self._wait_for_retiring(pool, req.pages)
            pool.target.map(req.pages)
        except _Failed:
            pool.remember(req.tx, _Tx(_TxState.MAP_FAILED))
            raise
        except Exception as exc:
            pool.remember(req.tx, _Tx(_TxState.MAP_FAILED))
            raise _data_plane_failure(pool, f"map of {len(req.pages)} pages", exc) from None
        pool.remember(req.tx, _Tx(_TxState.MAPPED, req.pages))
        return Status.OK

    def _wait_for_retiring(self, pool: _PoolRank, pages: tuple[int, ...]) -> None:
        busy = [p for p in pages if p in pool.retiring]
        if not busy:
            return
        epoch = max(pool.queued[pool.retiring[p]].epoch for p in busy)
        if self.fence.wait(epoch, self.busy_wait):
            pool.drain(self.fence)
        still = [p for p in pages if p in pool.retiring]
        if still:
            raise _Failed(
                Code.BUSY,
                f"pages {still[:8]} are still retiring behind epoch {epoch} "
                f"(finished: {self.fence.finished})",
            )

    def _rollback(self, pool: _PoolRank, req: Request) -> Status:
        record = pool.lookup(req.tx, req.op)
        if record is None:  # the MAP never arrived: make sure it is never applied
            pool.remember(req.tx, _Tx(_TxState.ROLLED_BACK))
            return Status.OK
        if record.state is _TxState.ROLLED_BACK:
            return Status.OK
        if record.state is _TxState.MAP_FAILED:
            record.state = _TxState.ROLLED_BACK
            return Status.OK
        if record.state is not _TxState.MAPPED:
            raise _Failed(
                Code.REFUSED, f"ROLLBACK of tx {req.tx} refused: it is an unmap ({record.state.value})"
            )
        with pool.break_on_failure(f"rollback of map tx {req.tx}"):
            # The map's own tx id names the undo, so the data plane's history records it too.
            pool.target.prepare(req.tx, record.pages)
            pool.target.commit(req.tx)
        record.state = _TxState.ROLLED_BACK
        return Status.OK

    def _prepare(self, pool: _PoolRank, req: Request) -> Status:
        record = pool.lookup(req.tx, req.op)
        if record is not None:
            if record.pages == req.pages and record.state is _TxState.PREPARED:
                return Status.OK
            if record.pages == req.pages and record.state is _TxState.QUEUED:
                return Status.QUEUED
            raise _Failed(Code.REFUSED, f"PREPARE of tx {req.tx} refused: the tx is {record.state.value}")
        problem = self._check_unmappable(pool, req.pages)
        if problem:
            pool.remember(req.tx, _Tx(_TxState.PREPARE_FAILED, req.pages, req.epoch))
            raise _Failed(Code.BAD_ARGUMENT, f"PREPARE of tx {req.tx}: {problem}")
        if req.epoch == NO_EPOCH or self.fence.reached(req.epoch):
            try:
                pool.target.prepare(req.tx, req.pages)
            except Exception as exc:
                pool.remember(req.tx, _Tx(_TxState.PREPARE_FAILED, req.pages, req.epoch))
                raise _data_plane_failure(pool, f"prepare of tx {req.tx}", exc) from None
            pool.remember(req.tx, _Tx(_TxState.PREPARED, req.pages, req.epoch))
            return Status.OK
        record = _Tx(_TxState.QUEUED, req.pages, req.epoch)
        pool.remember(req.tx, record)
        pool.queued[req.tx] = record
        for page in req.pages:
            pool.retiring[page] = req.tx
        return Status.QUEUED

    @staticmethod
    def _check_unmappable(pool: _PoolRank, pages: tuple[int, ...]) -> str:
        if len(set(pages)) != len(pages):
            return "duplicate pages"
        for page in pages:
            if page >= pool.target.num_pages:
                return f"page {page} is out of range [0, {pool.target.num_pages})"
            if page in pool.retiring:
                return f"page {page} is already being unmapped by tx {pool.retiring[page]}"
            if not pool.target.is_mapped(page):
                return f"page {page} is not mapped"
        return ""

    def _commit(self, pool: _PoolRank, req: Request) -> Status:
        record = pool.history.get(req.tx)
        if record is None:
            raise _Failed(Code.UNKNOWN_TX, f"COMMIT of tx {req.tx}: no record (prepare never arrived here)")
        if record.state is _TxState.COMMITTED:
            return Status.OK
        if record.state in (_TxState.QUEUED, _TxState.COMMIT_QUEUED):
            record.state = _TxState.COMMIT_QUEUED
            return Status.QUEUED
        if record.state is not _TxState.PREPARED:
            raise _Failed(Code.REFUSED, f"COMMIT of tx {req.tx} refused: the tx is {record.state.value}")
        with pool.break_on_failure(f"commit of tx {req.tx}"):
            pool.target.commit(req.tx)
        record.state = _TxState.COMMITTED
        return Status.OK

    def _abort(self, pool: _PoolRank, req: Request) -> Status:
        record = pool.lookup(req.tx, req.op)
        if record is None:  # the PREPARE never arrived: refuse it if it comes late
            pool.remember(req.tx, _Tx(_TxState.ABORTED))
            return Status.OK
        state = record.state
        if state in _MAP_STATES:
            raise _Failed(Code.REFUSED, f"ABORT of tx {req.tx} refused: it is a map ({state.value})")
        if state in (_TxState.COMMITTED, _TxState.COMMIT_QUEUED):
            raise _Failed(Code.REFUSED, f"ABORT of tx {req.tx} refused: it is {state.value}")
        if state is _TxState.QUEUED:  # never applied: nothing to restore
            del pool.queued[req.tx]
            for page in record.pages:
                pool.retiring.pop(page, None)
        elif state is _TxState.PREPARED:
            with pool.break_on_failure(f"abort of tx {req.tx}"):
                pool.target.abort(req.tx)
        record.state = _TxState.ABORTED
        return Status.OK
