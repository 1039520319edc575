"""Epoch fence: "device work of every engine step up to epoch E has finished", per rank.

Problem (kvcached#463): with asynchronous scheduling the scheduler frees blocks, and the ledger decides to
unmap a page, while device work launched for earlier steps may still read that page. Unmapping then faults (or
reads the zero page). A device-wide synchronize before every unmap would be correct but stalls every stream of
the device on the steady-state path.

Design: the engine numbers its steps (epochs, starting at 1) and tells each rank how far the device has got,
in one of two ways, both cheap:

* ``finish(E)`` -- the engine knows that work through epoch E finished (it has the step's outputs on the host,
  or the coordinator piggybacks that knowledge on a request);
* ``record(E, completion)`` -- the engine hands over an object that *will* say so: anything with a
  non-blocking ``query()``, e.g. a ``torch.cuda.Event`` recorded on the step's stream after its last kernel.
  Waiting for epoch E then waits for exactly that event, never for the whole device.

An unmap tagged with epoch E is applied once ``reached(E)``. Invariant: ``finished`` only grows, and a
recorded completion for epoch E must cover all device work of epochs <= E (record it after the step's last
kernel on the stream that the step's other streams join), so completions are consulted oldest first.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Protocol

__all__ = ["Completion", "EpochFence"]

# Polling a completion costs a driver query (~1 us); back off from 50 us to 1 ms while waiting.
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 1e-3


class Completion(Protocol):
    """Something that finishes once the device work recorded before it has finished (torch.cuda.Event)."""

    def query(self) -> bool:
        """True once the work has finished; never blocks."""
        ...


class EpochFence:
    """Tracks how far each rank's device work has progressed, in engine epochs. Thread-safe.

    ``finish``/``record`` are called by the engine (any thread); ``reached``/``wait`` by the rank's protocol
    handler. ``interrupt`` wakes every waiter (listener shutdown) and makes later waits return at once.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._finished = 0
        # (epoch, completion), epochs increasing; a deque because completions retire from the left.
        self._recorded: collections.deque[tuple[int, Completion]] = collections.deque()
        self._interrupted = False

    @property
    def finished(self) -> int:
        """Highest epoch known to be finished (0: none). Lock-free: one int read, and the value only grows."""
        return self._finished

    def finish(self, epoch: int) -> None:
        """Declare that device work of every epoch <= ``epoch`` has finished. Lower values are ignored."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        with self._cond:
            if epoch > self._finished:
                self._advance(epoch)

    def record(self, epoch: int, completion: Completion) -> None:
        """Register ``completion`` as the end of epoch ``epoch``'s device work.

        Epochs must be recorded in increasing order (ValueError otherwise); an epoch already finished is
        ignored.
        """
        with self._cond:
            if epoch <= self._finished:
                return
            if self._recorded and epoch <= self._recorded[-1][0]:
                raise ValueError(f"epoch {epoch} recorded after epoch {self._recorded[-1][0]}")
            self._recorded.append((epoch, completion))
            self._cond.notify_all()

    def reached(self, epoch: int) -> bool:
        """True when work through ``epoch`` has finished; polls recorded completions, never blocks."""
        with self._cond:
            self._poll()
            return epoch <= self._finished

    def wait(self, epoch: int, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until ``reached(epoch)``; False on timeout or interrupt.

        Waits on the recorded completion of the first epoch >= ``epoch`` (polling it with a short back-off)
        or for a ``finish``/``record`` call -- never on the whole device.
        """
        deadline = time.monotonic() + timeout
        delay = _POLL_MIN_S
        with self._cond:
            while True:
                self._poll()
                if epoch <= self._finished:
                    return True
                remaining = deadline - time.monotonic()
                if self._interrupted or remaining <= 0:
                    return False
                if any(e >= epoch for e, _ in self._recorded):
                    # The work is on the device already: poll its completion.
                    self._cond.wait(min(delay, remaining))
                    delay = min(delay * 2, _POLL_MAX_S)
                else:
                    self._cond.wait(remaining)

    def interrupt(self) -> None:
        """Wake every waiter; from now on ``wait`` returns at once (used when a listener shuts down)."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def _poll(self) -> None:
        while self._recorded and self._recorded[0][1].query():
            self._advance(self._recorded[0][0])

    def _advance(self, epoch: int) -> None:
        self._finished = max(self._finished, epoch)
        while self._recorded and self._recorded[0][0] <= self._finished:
            self._recorded.popleft()
        self._cond.notify_all()
