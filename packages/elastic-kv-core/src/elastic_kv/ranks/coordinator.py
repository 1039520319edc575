"""Coordinator side of the ranks protocol: a ``PageMapper`` over every rank of every pipeline stage.

The coordinator lives where the decisions are made (the engine's scheduler) and drives the ranks (the
processes that own device memory) through a :class:`~elastic_kv.ranks.transport.Transport`:

* ``map(pages)``: MAP to every rank. Success only when every rank mapped. Otherwise ROLLBACK to every rank
  (ranks that mapped unmap the pages, ranks that failed or never saw the MAP record a tombstone) and raise the
  ranks' error; the pool is unchanged everywhere.
* ``unmap(pages, epoch)``: PREPARE to every rank (unmap, keep the handles; queued on a rank until device work
  through ``epoch`` finished there), then COMMIT (release). If any PREPARE fails, ABORT everywhere (restore)
  and raise. An ambiguous COMMIT (a rank timed out) is retried -- now, and before every later call -- and
  never turned into an ABORT: once every rank has prepared, the unmap has happened.

A rank that is gone, reports its pool inconsistent, or answers in a way the protocol does not allow, and a
rollback or abort that cannot be confirmed on every rank, put the coordinator in the consistency-error state:
the ranks' mappings may differ, so every later call raises :class:`StateConsistencyError` with the reason. The
pool is never allowed to diverge silently.

Errors raised after a clean rollback (the pool is unchanged on every rank): ``PoolExhausted`` (a rank had no
memory, or a page was still retiring behind its epoch), ``ValueError`` (bad pages), ``TimeoutError`` (a rank
did not answer in time; the rollback reached every rank), ``elastic_kv._vmm.BackendError`` (a driver call
failed on a rank for a reason other than memory, as ``LocalMapper`` would raise it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_kv.errors import PoolExhausted, StateConsistencyError
from elastic_kv.ranks.messages import NO_EPOCH, Code, Op, RankInfo, Reply, Request
from elastic_kv.ranks.transport import NoReply, Outcome, Transport

try:
    from elastic_kv._vmm import BackendError
except ImportError:  # a coordinator-only install: the same meaning, the base type
    BackendError = RuntimeError  # type: ignore[assignment,misc]

__all__ = ["Coordinator", "RankStatus"]

logger = logging.getLogger(__name__)

# Error codes after which the rank's state is known to be unchanged.
_CLEAN_CODES = frozenset({Code.BAD_ARGUMENT, Code.EXHAUSTED, Code.BUSY, Code.BACKEND, Code.SHUTTING_DOWN})


@dataclass(frozen=True, slots=True)
class RankStatus:
    """One rank's answer to STATUS: its counters and its mapped pages (sorted)."""

    info: RankInfo
    mapped_pages: tuple[int, ...]


@dataclass(slots=True)
class _Split:
    """Outcomes of one broadcast, sorted by what they mean for the pool."""

    done: list[int]
    clean: list[Reply]  # failed without changing the rank
    unknown: list[str]  # may or may not have applied; a retry or rollback can still settle it
    fatal: list[str]  # gone, inconsistent, or a protocol violation: the pool cannot continue

    @property
    def all_done(self) -> bool:
        return not (self.clean or self.unknown or self.fatal)


def _describe(outcome: Outcome) -> str:
    if isinstance(outcome, NoReply):
        return f"rank {outcome.rank} {'gone' if outcome.gone else 'no reply'} ({outcome.reason})"
    return f"rank {outcome.rank} {outcome.code.name} ({outcome.message})"


class Coordinator:
    """Implements ``PageMapper`` (``map``/``unmap``) for pool ``pool`` over all ranks behind ``transport``.

    The constructor performs a handshake (STATUS to every rank): every rank must answer, serve the pool, speak
    this protocol version, agree on the number of pages and hold the same mapped pages; otherwise it raises
    ``StateConsistencyError`` (or ``TimeoutError`` when a rank does not answer within ``handshake_timeout``).
    Transaction ids continue above the highest id any rank has seen, so a coordinator may be rebuilt over live
    ranks. Public methods are thread-safe (one call at a time). The transport is owned by the caller.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        pool: int = 0,
        timeout: float = 10.0,
        retries: int = 3,
        handshake_timeout: float = 60.0,
    ) -> None:
        """``timeout``: seconds one broadcast waits for the ranks. ``retries``: attempts for a rollback,
        abort or commit whose outcome is ambiguous on some rank."""
        if timeout <= 0 or handshake_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if retries < 1:
            raise ValueError(f"retries must be >= 1, got {retries}")
        self._transport = transport
        self.pool = pool
        self._timeout = timeout
        self._retries = retries
        self._lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._error = ""
        self._finished_epoch = NO_EPOCH
        self._pending_commits: list[int] = []
        statuses = self._status(handshake_timeout)
        self.num_pages = statuses[0].info.num_pages
        self._next_tx = max(s.info.last_tx for s in statuses) + 1

    # --- PageMapper ----------------------------------------------------------------------------
    def map(self, pages: Sequence[int]) -> None:
        """Back ``pages`` on every rank, all or nothing.

        Raises ``ValueError`` (bad pages), ``PoolExhausted``, ``TimeoutError``, ``_vmm.BackendError`` -- each
        after a rollback that left every rank unchanged -- or ``StateConsistencyError`` (the pool is now in
        the error state).
        """
        with self._lock:
            checked = self._begin(pages)
            if not checked:
                return
            tx = self._new_tx()
            split = self._split(self._send(Op.MAP, tx, checked))
            if split.all_done:
                return
            self._undo(Op.ROLLBACK, tx, f"map of pages {_short(checked)}", split)

    def unmap(self, pages: Sequence[int], epoch: int = NO_EPOCH) -> None:
        """Release ``pages`` on every rank (two-phase), after device work through ``epoch`` finished on each.

        ``epoch`` is the last engine step whose queued device work may still read the pages (``NO_EPOCH``:
        none). A rank where that work has not finished keeps the pages backed until it has, without blocking
        this call. Raises like :meth:`map`; once this returns the pages belong to no one.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        with self._lock:
            checked = self._begin(pages)
            if not checked:
                return
            tx = self._new_tx()
            split = self._split(self._send(Op.PREPARE, tx, checked, epoch))
            if split.all_done:
                self._commit(tx)
                return
            self._undo(Op.ABORT, tx, f"unmap of pages {_short(checked)}", split)

    # --- epochs and introspection ---------------------------------------------------------------
    def finish_epoch(self, epoch: int) -> None:
        """Record that device work through ``epoch`` finished on every rank (the scheduler saw the step's
        output). It rides on the next request; call :meth:`sync` to deliver it now."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        with self._lock:
            self._finished_epoch = max(self._finished_epoch, epoch)

    def sync(self) -> list[RankInfo]:
        """Deliver the finished epoch, let every rank apply its due queued unmaps, retry pending commits.

        Returns every rank's counters. Raises ``TimeoutError`` when a rank does not answer, and
        ``StateConsistencyError`` when one is gone or inconsistent.
        """
        with self._lock:
            self._check()
            self._retry_pending_commits()
            infos: list[RankInfo] = []
            for outcome in self._send(Op.SYNC):
                info = self._expect_reply(outcome, "sync").info
                assert info is not None  # _expect_reply checked it
                infos.append(info)
            return infos

    def status(self) -> list[RankStatus]:
        """Every rank's counters and mapped pages; puts the pool in the error state if they diverge."""
        with self._lock:
            self._check()
            return self._status(self._timeout)

    @property
    def consistent(self) -> bool:
        """False once the pool is in the consistency-error state."""
        return not self._error

    @property
    def error(self) -> str:
        """Why the pool is in the consistency-error state ("" when it is not)."""
        return self._error

    @property
    def pending_commits(self) -> tuple[int, ...]:
        """Transactions whose COMMIT some rank has not confirmed yet (retried before every call)."""
        return tuple(self._pending_commits)

    def close(self) -> None:
        """Retry pending commits once (best effort); the transport stays open (its owner closes it)."""
        with self._lock:
            if not self._error and self._pending_commits:
                with contextlib.suppress(StateConsistencyError):
                    self._retry_pending_commits()

    # --- internals ------------------------------------------------------------------------------
    def _begin(self, pages: Sequence[int]) -> tuple[int, ...]:
        self._check()
        try:  # operator.index: any integer type (numpy's included), never a float or a bool
            checked = tuple(operator.index(p) for p in pages if not isinstance(p, bool))
        except TypeError:
            checked = ()
        if len(checked) != len(pages) or any(not 0 <= p < self.num_pages for p in checked):
            bad = next((p for p in pages if isinstance(p, bool) or not _in_range(p, self.num_pages)), pages)
            raise ValueError(f"page {bad!r} is not an integer in [0, {self.num_pages})")
        if len(set(checked)) != len(checked):
            raise ValueError("duplicate pages")
        if self._pending_commits:
            self._retry_pending_commits()
        return checked

    def _check(self) -> None:
        if self._error:
            raise StateConsistencyError(
                f"elastic-kv pool {self.pool} is in the consistency-error state: {self._error}"
            )

    def _fail(self, why: str) -> StateConsistencyError:
        self._error = f"{why}. The ranks' mappings may differ; the pool must be rebuilt"
        logger.error("pool %d enters the consistency-error state: %s", self.pool, why)
        return StateConsistencyError(
            f"elastic-kv pool {self.pool} is in the consistency-error state: {self._error}"
        )

    def _new_tx(self) -> int:
        tx = self._next_tx
        self._next_tx += 1
        return tx

    def _send(
        self, op: Op, tx: int = 0, pages: tuple[int, ...] = (), epoch: int = NO_EPOCH, timeout: float = 0.0
    ) -> list[Outcome]:
        req = Request(op, next(self._request_ids), self.pool, tx, pages, epoch, self._finished_epoch)
        outcomes = self._transport.broadcast(req, timeout or self._timeout)
        n = self._transport.world_size
        if len(outcomes) != n:
            raise self._fail(f"the transport returned {len(outcomes)} outcomes for {n} ranks")
        checked: list[Outcome] = []
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Reply) and (
                outcome.request_id != req.request_id or outcome.rank != i or outcome.pool != req.pool
            ):
                outcome = NoReply(
                    i,
                    f"mismatched reply (request {outcome.request_id}, rank {outcome.rank}, "
                    f"pool {outcome.pool}) to request {req.request_id} for rank {i}",
                )
            checked.append(outcome)
        return checked

    @staticmethod
    def _split(outcomes: list[Outcome]) -> _Split:
        split = _Split([], [], [], [])
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, NoReply):
                (split.fatal if outcome.gone else split.unknown).append(_describe(outcome))
            elif outcome.ok:
                split.done.append(i)
            elif outcome.code in _CLEAN_CODES:
                split.clean.append(outcome)
            else:
                split.fatal.append(_describe(outcome))
        return split

    def _settle(self, op: Op, tx: int) -> tuple[list[str], list[str]]:
        """Broadcast an idempotent ``op`` for ``tx`` until every rank confirms it or ``retries`` run out.

        Returns ``(fatal, unconfirmed)`` descriptions; both empty means every rank confirmed.
        """
        unconfirmed: list[str] = []
        for _ in range(self._retries):
            split = self._split(self._send(op, tx))
            unconfirmed = split.unknown + [_describe(r) for r in split.clean]
            if split.fatal or not unconfirmed:
                return split.fatal, unconfirmed
        return [], unconfirmed

    def _undo(self, op: Op, tx: int, what: str, split: _Split) -> None:
        """After a failed MAP/PREPARE: ROLLBACK/ABORT everywhere, then raise the error that fits."""
        what = f"{what} (tx {tx})"
        fatal, unconfirmed = self._settle(op, tx)
        problems = split.fatal + fatal
        if problems or unconfirmed:
            failed = "; ".join(split.fatal + split.unknown + [_describe(r) for r in split.clean])
            undo = "; ".join(fatal + unconfirmed) or "confirmed"
            raise self._fail(f"{what} failed on {failed}; {op.name.lower()}: {undo}")
        codes = {r.code for r in split.clean}
        detail = "; ".join([_describe(r) for r in split.clean] + split.unknown)
        if codes & {Code.EXHAUSTED, Code.BUSY}:
            raise PoolExhausted(f"{what} failed, rolled back on every rank: {detail}")
        if Code.BAD_ARGUMENT in codes:
            raise ValueError(f"{what} failed, rolled back on every rank: {detail}")
        if Code.BACKEND in codes:
            raise BackendError(f"{what} failed, rolled back on every rank: {detail}")
        raise TimeoutError(f"{what} failed, rolled back on every rank: {detail}")

    def _commit(self, tx: int) -> None:
        fatal, unconfirmed = self._settle(Op.COMMIT, tx)
        if fatal:
            raise self._fail(f"commit of tx {tx} failed: {'; '.join(fatal + unconfirmed)}")
        if unconfirmed:
            # Every rank prepared, so the pages are unmapped everywhere; only the release of retained handles
            # is unconfirmed. Never abort: retry before every later call.
            logger.warning("commit of tx %d unconfirmed (%s); retrying later", tx, "; ".join(unconfirmed))
            self._pending_commits.append(tx)

    def _retry_pending_commits(self) -> None:
        pending, self._pending_commits = self._pending_commits, []
        for tx in pending:
            self._commit(tx)

    def _expect_reply(self, outcome: Outcome, what: str) -> Reply:
        if isinstance(outcome, NoReply):
            if outcome.gone:
                raise self._fail(f"{what}: {_describe(outcome)}")
            raise TimeoutError(f"{what}: {_describe(outcome)}")
        if not outcome.ok or outcome.info is None:
            raise self._fail(f"{what}: unexpected answer from {_describe(outcome)}")
        if not outcome.info.consistent:
            raise self._fail(f"{what}: rank {outcome.rank} reports its pool inconsistent")
        return outcome

    def _status(self, timeout: float) -> list[RankStatus]:
        statuses: list[RankStatus] = []
        for outcome in self._send(Op.STATUS, timeout=timeout):
            reply = self._expect_reply(outcome, "status")
            assert reply.info is not None  # _expect_reply checked it
            statuses.append(RankStatus(reply.info, reply.pages))
        first = statuses[0]
        for i, s in enumerate(statuses):
            if s.info.num_pages != first.info.num_pages:
                raise self._fail(f"rank {i} has {s.info.num_pages} pages, rank 0 has {first.info.num_pages}")
            if s.mapped_pages != first.mapped_pages:
                diff = sorted(set(s.mapped_pages) ^ set(first.mapped_pages))
                raise self._fail(f"ranks 0 and {i} map different pages (they differ on {_short(diff)})")
        return statuses


def _in_range(page: object, num_pages: int) -> bool:
    try:
        return 0 <= operator.index(page) < num_pages  # type: ignore[arg-type]
    except TypeError:
        return False


def _short(pages: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(p) for p in pages[:limit])
    return f"[{shown}{', ...' if len(pages) > limit else ''}] ({len(pages)} pages)"
