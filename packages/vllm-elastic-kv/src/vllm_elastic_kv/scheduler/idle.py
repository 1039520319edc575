"""``kvctl`` on an idle vLLM engine: a trim or a limit takes effect without waiting for a request.

The ledger belongs to the scheduler's thread, which is vLLM's engine-core loop; while the engine is idle
that loop blocks on its input queue, so nothing the pool's records say (``kvctl trim``, ``kvctl limit``, a
device budget) is applied until a request arrives. :class:`IdleControl` watches the records' revisions from
a daemon thread (three integers read from the mappings every ``period_s``: no lock, no system call) and,
when one changes, hands the engine core a callback and wakes it up -- with vLLM's own means: the callback
joins ``EngineCore._idle_state_callbacks``, which the loop runs *on its thread* each time it finds no
work, and a ``WAKEUP`` request (what vLLM's shutdown path sends) unblocks the queue. A busy engine runs the
callback once it is idle again; its steps apply the change meanwhile.

The same wake-up serves a scheduler that stalled (:class:`vllm_elastic_kv.scheduler.fit.Stall`: nothing can
run until memory frees): ``wake_when``, polled with the revisions, says when the room outside the pool grew,
and the callback then ends the stall on the loop's thread. vLLM's loop runs idle callbacks and then blocks on
its queue in one pass (and a ``WAKEUP`` may have been consumed while the engine was busy), so a callback that
leaves the engine with work returns True, and another ``WAKEUP`` makes the loop look again.

Only the engine core's busy loop (``EngineCoreProc``, vLLM's default) has that queue; an in-process engine
core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has no loop to wake, and changes apply at its next step.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from elastic_kv.registry import PoolRecord

__all__ = ["IdleControl", "constructing_engine_core"]

logger = logging.getLogger(__name__)


def constructing_engine_core() -> Any | None:
    """The ``EngineCoreProc`` whose constructor is building the scheduler that calls this, else None.

    vLLM gives a scheduler no reference to its engine core; its constructor is a few frames up, and an
    ``EngineCoreProc`` creates its input queue before it builds the scheduler.
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if hasattr(candidate, "input_queue") and hasattr(candidate, "_handle_client_request"):
            return candidate
        frame = frame.f_back
    return None


class IdleControl:
    """Wakes an idle engine core to run ``on_idle`` on its thread when ``records``' revisions change (or
    ``wake_when`` says so); ``on_idle`` returns True when the engine has work after it."""

    def __init__(
        self,
        engine_core: Any,
        records: Sequence[PoolRecord],
        on_idle: Callable[[], bool],
        period_s: float = 0.05,
        wake_when: Callable[[], bool] | None = None,
    ) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        self._core = engine_core
        self._records = tuple(records)
        self._on_idle = on_idle
        self._wake_when = wake_when
        self._period = period_s
        self._wakeup = (EngineCoreRequestType.WAKEUP, None)
        self._stop = threading.Event()
        self._queued = threading.Event()  # a callback waits in the engine core's list
        self._thread = threading.Thread(target=self._watch, name="elastic-kv-idle", daemon=True)

    @classmethod
    def for_engine(
        cls,
        engine_core: Any,
        records: Sequence[PoolRecord],
        on_idle: Callable[[], bool],
        wake_when: Callable[[], bool] | None = None,
    ) -> IdleControl | None:
        """A started watcher, or None (logged) when this vLLM has no idle callbacks or wake-up request.
        ``on_idle`` returns True when it left the engine with work; ``wake_when`` (polled every period, on
        the watcher's thread): also wake the engine when it says so."""
        from vllm.v1.engine import EngineCoreRequestType

        # The engine core creates its list of idle callbacks after the scheduler: it is looked up when used.
        if engine_core is None or not hasattr(EngineCoreRequestType, "WAKEUP"):
            logger.info("elastic KV: kvctl changes apply at the engine's next step (no idle wake-up here)")
            return None
        control = cls(engine_core, records, on_idle, wake_when=wake_when)
        control._thread.start()
        return control

    def _revisions(self) -> list[tuple[int, int, int]]:
        return [record.control_revision() for record in self._records]

    def _watch(self) -> None:
        seen = self._revisions()
        while not self._stop.wait(self._period):
            try:
                now = self._revisions()
            except ValueError:  # a record closed: the engine is shutting down
                return
            callbacks = getattr(self._core, "_idle_state_callbacks", None)
            if self._queued.is_set() or not isinstance(callbacks, list):
                continue
            if now != seen or (self._wake_when is not None and self._wake_when()):
                seen = now
                self._queued.set()
                callbacks.append(self._run)
                self._core.input_queue.put_nowait(self._wakeup)

    def _run(self, _engine_core: Any) -> None:
        self._queued.clear()
        try:
            busy = self._on_idle()
        except Exception:
            logger.exception("elastic KV: applying kvctl's change to the idle engine failed")
            return
        if busy:  # the loop blocks on its queue right after its idle callbacks: have it look again
            self._core.input_queue.put_nowait(self._wakeup)

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
