"""Requests that cannot fit under the pool's ceiling: what each needs, ending those that never can, and
waiting without spinning while nothing can run.

The pool's *ceiling* is the tightest of its ``kvctl`` limit and its device's budget; the ledger counts what
requests can hold under it (:attr:`elastic_kv.ledger.Ledger.max_request_blocks`). vLLM checks at start-up that
its KV cache holds a request of ``max_model_len`` tokens, so natively a request always fits once the others
are gone; under a ceiling it may not, and vLLM would preempt it and retry it at every step for as long as
the ceiling stays -- a request that hangs, and an engine loop that spins.

* **What a request needs** (:class:`RequestNeeds`): to take its next step a request holds the KV of every
  token it has (prompt and output) that its layers still attend to: per KV cache group, full attention
  and MLA ``cdiv(num_tokens, block_size)`` blocks, sliding window those of the last ``sliding_window``
  tokens, chunked local attention and Mamba state at least one block. That is a lower bound (lookahead
  slots, copy-on-write blocks and a sliding window's straddling block come on top), so a request is never
  ended for a need it might not have.
* **When "never" applies** (:meth:`RequestFit.end_unfit`, at the start of every ``schedule()``): a request
  -- waiting, preempted or running -- whose need exceeds what the ceiling lets requests hold together cannot
  run even alone, whatever the others do; only raising the ceiling would help, and ``kvctl`` refuses to
  lower it there without ``--force``. Such a request ends now with vLLM's request-level error
  (``RequestStatus.FINISHED_ERROR``, finish reason ``error``; its ``stop_reason`` says why), through
  vLLM's own ``finish_requests`` -- the path of an abort -- and an output emitted with the step's outputs,
  as vLLM does for a grammar that failed to compile. A running request that grows past the ceiling ends
  at the step that would need the block it cannot have. Each one is logged in one line, and counted in the
  pool's snapshot (``failed_requests``).
* **Waiting without spinning** (:class:`Stall`): a request that fits under the ceiling but not now (another
  pool holds the device's budget, the driver has no free memory) waits, as natively. vLLM's engine loop
  steps again as soon as a step scheduled nothing, and each empty step keeps vLLM's multiprocess workers
  polling their queue for a second; so a step that scheduled nothing because memory was refused, with no
  step in flight, stalls the scheduler: vLLM's loop blocks on its input queue as when idle, until a request
  arrives or is aborted, ``kvctl`` changes a record, or the room outside the pool grows (the idle watcher,
  :class:`vllm_elastic_kv.scheduler.idle.IdleControl`, sees the last two and wakes the loop).
* **When the estimate was short** (:meth:`RequestFit.refused_alone`): the need above is a lower bound, and
  some requests hold more than it (under prefix caching a GDN or Mamba group may take a state checkpoint
  block beside its state, and a preempted request's own cached blocks are hits it holds beside its new
  ones). So a step that scheduled nothing because a request was
  refused memory, with no step in flight, no block held by any request and every block requests may hold
  under the ceiling free or evictable, shows that request cannot run under it: nothing the engine waits for
  would give it more. One refusal may be transient (the ledger had not yet applied a ``kvctl`` change, an
  admission could not back its whole bound), so the next step tries again at once, after the step's
  housekeeping has applied what changed; refused again the same way, the request ends as above. (Natively
  such a request is computed, preempted and computed again for as long as the engine runs.)
* **What ``kvctl`` sees** (:meth:`RequestFit.observe`): the largest unfinished request's need is published
  with the pool's snapshot (``largest_request_bytes``), so ``kvctl`` refuses a limit or a budget below it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from elastic_kv.ledger import Ledger
from elastic_kv.registry import PoolRecord
from elastic_kv.sizes import format_bytes

__all__ = ["RequestFit", "RequestNeeds", "Stall"]

logger = logging.getLogger(__name__)


def _group_need(spec: Any) -> tuple[int, int, int]:
    """(block size, tokens attended at most (0: all), least blocks) of one KV cache group's spec."""
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    kind = type(next(iter(inner.values()))).__name__ if inner else type(spec).__name__
    size = int(spec.block_size)
    if kind in ("FullAttentionSpec", "MLAAttentionSpec"):
        return size, 0, 0
    if kind == "SlidingWindowSpec":
        window = getattr(next(iter(inner.values())), "sliding_window", 0) if inner else spec.sliding_window
        return size, max(1, int(window)), 0
    if kind in ("ChunkedLocalAttentionSpec", "MambaSpec"):
        return size, 1, 1
    return size, 1, 0  # a spec the plugin would have refused at start-up: no need counted


class RequestNeeds:
    """The least blocks a request of ``n`` tokens holds to take its next step, over every KV cache group
    of ``kv_cache_config`` (see the module docstring), and the longest request that fits a block count."""

    def __init__(self, kv_cache_config: Any, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self._groups = [_group_need(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
        self._fit_for: tuple[int, int] = (-1, 0)  # (blocks, longest request that fits them)

    def blocks(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at least to take its next step."""
        if num_tokens <= 0:
            return 0
        total = 0
        for size, attended, least in self._groups:
            tokens = min(num_tokens, attended) if attended else num_tokens
            total += max(least, -(-tokens // size))
        return total

    def longest_within(self, blocks: int) -> int:
        """The most tokens a request may have and still need no more than ``blocks`` blocks (at most
        ``max_model_len``; cached for the last ``blocks`` asked)."""
        if self._fit_for[0] == blocks:
            return self._fit_for[1]
        lo, hi = 0, self.max_model_len  # blocks(lo) <= blocks holds; find the largest such lo
        if self.blocks(hi) <= blocks:
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks(mid) <= blocks:
                lo = mid
            else:
                hi = mid - 1
        self._fit_for = (blocks, lo)
        return lo


class RequestFit:
    """Ends the requests of one elastic scheduler that can never fit under its pool's ceiling, publishes
    what its largest request needs, and keeps the outputs of the requests it ended until the step's outputs
    are built (see the module docstring). Runs on the scheduler's thread."""

    def __init__(
        self, needs: RequestNeeds, ledger: Ledger, pool_name: str, publish_interval_s: float
    ) -> None:
        self.needs = needs
        self._ledger = ledger
        self._name = pool_name
        self._interval = publish_interval_s
        self._observed_at = float("-inf")
        self._largest = 0  # tokens of the largest unfinished request seen
        self._ended: list[tuple[Any, str]] = []  # (request, why) ended since the last outputs
        self._suspect: tuple[Any, int] = (None, -1)  # (request, step) refused alone once
        self._refused: Any = None  # refused alone twice in a row: ends at the next observe()

    # -- what the largest request needs -------------------------------------------------------------------
    def request_added(self, num_tokens: int) -> None:
        """A request of ``num_tokens`` tokens arrived: the largest need grows at once if it is larger."""
        if num_tokens > self._largest:
            self._largest = num_tokens
            self._ledger.note_largest_request(self.needs.blocks(num_tokens))

    def went_idle(self) -> None:
        """No request is left: nothing needs anything."""
        self._largest = 0
        self._ledger.note_largest_request(0)

    def refused_alone(self, request: Any, referenced: int, obtainable: int, step: int) -> bool:
        """Step ``step`` scheduled nothing because ``request`` was refused memory, and no step is in
        flight: whether the scheduler should try again at once rather than wait for room -- no block is held
        by a request (``referenced``) and the pool could give it ``obtainable`` blocks (its evictable cached
        blocks and all it may still back), every block requests may hold under the ceiling (see the module
        docstring). Refused so at two steps in a row, it ends at the next :meth:`observe`."""
        if request is None or referenced or request.is_finished():
            return False
        if obtainable < self._ledger.max_request_blocks_now():
            return False  # room may come (another pool's budget, the driver's memory): wait for it
        suspect, at = self._suspect
        if suspect is request and at == step - 1:
            self._suspect, self._refused = (None, -1), request
        else:
            self._suspect = (request, step)
        return True

    # -- once per schedule() ------------------------------------------------------------------------------
    def observe(self, scheduler: Any) -> None:
        """At the start of ``schedule()``: end the requests that need more than the ceiling lets requests
        hold (every step while the ceiling is below what a request of ``max_model_len`` tokens needs) or
        that were refused with every block they may hold free (:meth:`refused_alone`), and refresh the
        largest request's need (at most every ``publish_interval_s`` otherwise)."""
        refused, self._refused = self._refused, None
        if refused is not None and not refused.is_finished():
            self._end_refused(scheduler, refused)
        longest = self.needs.longest_within(self._ledger.max_request_blocks)
        binding = longest < self.needs.max_model_len
        now = time.monotonic()
        if not binding and now - self._observed_at < self._interval:
            return
        self._observed_at = now
        largest, unfit = 0, []
        for request in scheduler.requests.values():
            tokens = request.num_tokens
            if request.is_finished():
                continue
            if tokens > longest:
                unfit.append(request)
            elif tokens > largest:
                largest = tokens
        if unfit:
            # The ceiling follows kvctl from maintain(); a raise made since must end nothing.
            longest = self.needs.longest_within(self._ledger.max_request_blocks_now())
            unfit = [request for request in unfit if request.num_tokens > longest]
        if unfit:
            self._end(scheduler, unfit, longest)
        if largest != self._largest:
            self._largest = largest
            self._ledger.note_largest_request(self.needs.blocks(largest))

    def _end(self, scheduler: Any, requests: Sequence[Any], longest: int) -> None:
        ledger = self._ledger
        room = f"at most {longest} tokens" if longest else "no request"
        why: dict[str, str] = {}
        for request in requests:
            need = format_bytes(ledger.bytes_for_blocks(self.needs.blocks(request.num_tokens)))
            why[request.request_id] = (
                f"needs more KV cache than pool {self._name} may hold: its {request.num_tokens} tokens "
                f"need at least {need}, and under the pool's limit or its device's budget a request can hold "
                f"{room}; raise the limit with kvctl"
            )
        self._finish(scheduler, why)

    def _end_refused(self, scheduler: Any, request: Any) -> None:
        most = format_bytes(self._ledger.bytes_for_blocks(self._ledger.max_request_blocks_now()))
        self._finish(scheduler, {request.request_id: (
            f"needs more KV cache than pool {self._name} may hold: its {request.num_tokens} tokens could not "
            f"be scheduled with all {most} that requests may hold under the pool's limit or its device's "
            "budget free; raise the limit with kvctl"
        )})  # fmt: skip

    def _finish(self, scheduler: Any, why: dict[str, str]) -> None:
        """End the requests of ``why`` (request id -> the reason) with vLLM's request-level error."""
        from vllm.v1.request import RequestStatus

        ledger = self._ledger
        ended = scheduler.finish_requests(list(why), RequestStatus.FINISHED_ERROR)
        for request in ended:
            logger.warning("request %s ended: %s", request.request_id, why[request.request_id])
            self._ended.append((request, why[request.request_id]))
        ledger.note_failed(len(ended))

    def add_outputs(self, outputs: dict[int, Any]) -> dict[int, Any]:
        """Add to a step's outputs (``update_from_output``'s, by client) the final output of every request
        ended since the last step: no token, finish reason ``error``, ``stop_reason`` saying why."""
        if not self._ended:
            return outputs
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        ended, self._ended = self._ended, []
        for request, why in ended:
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    stop_reason=why,
                )
            )
        return outputs


class Stall:
    """Whether the scheduler stalled: its last step scheduled nothing because memory was refused, and no
    step is in flight; and how it waits for room without spinning (see the module docstring).

    With an engine-core loop that ``IdleControl`` can wake (``wakeable``), a stalled scheduler reports no
    requests to schedule (``has_requests``), so vLLM's loop blocks on its input queue as when idle and no
    empty step reaches the workers (vLLM's multiprocess workers poll their queue busily for a second after
    every step). The stall ends when a request arrives or ends (``add_request``, ``finish_requests``), and
    when the watcher's :meth:`room_grew` or a ``kvctl`` change runs the idle callback (:meth:`end`).
    Without such a loop (an in-process engine core, whose requests come from the thread that steps it),
    :meth:`wait` blocks the scheduler's thread instead, up to ``period_s``, checking every ``slice_s``.

    ``room``: the room outside the pool now (:meth:`elastic_kv.ledger.Ledger.outside_room`); ``records``:
    the pool's records, whose control revisions move when ``kvctl`` changes them."""

    def __init__(
        self,
        room: Callable[[], int],
        records: Sequence[PoolRecord],
        *,
        wakeable: bool,
        period_s: float = 0.25,
        slice_s: float = 0.02,
    ) -> None:
        self._room = room
        self._records = tuple(records)
        self.wakeable = wakeable
        self._period = period_s
        self._slice = slice_s
        self.stalled = False
        self._room_at_stall = 0
        self.stalls = 0  # times the scheduler stalled (diagnostics, tests)

    def begin(self) -> None:
        """The step just scheduled scheduled nothing for want of memory, with no step in flight."""
        self._room_at_stall = self._room()
        self.stalled = True
        self.stalls += 1

    def end(self) -> None:
        """Something may have changed: schedule again."""
        self.stalled = False

    def room_grew(self) -> bool:
        """While stalled: whether the room outside the pool grew since the stall began (another pool
        released its budget, the driver has more free memory). Any thread; False once the records close."""
        if not self.stalled:
            return False
        try:
            return self._room() > self._room_at_stall
        except ValueError:  # a record closed: the engine is shutting down
            return False

    def _revisions(self) -> list[tuple[int, int, int]]:
        return [record.control_revision() for record in self._records]

    def wait(self) -> float:
        """Block until the room grew, a ``kvctl`` change, or ``period_s``; end the stall; return the seconds
        waited (the in-process engine core's way, see the class docstring)."""
        start = time.monotonic()
        deadline = start + self._period
        seen = self._revisions()
        while not self.room_grew() and self._revisions() == seen:
            now = time.monotonic()
            if now >= deadline:
                break
            time.sleep(min(self._slice, deadline - now))
        self.end()
        return time.monotonic() - start
