"""Making room on the device: a model that wakes or starts needs its weights plus the KV it held when idle
within ``[server] budget``. Idle models are put to sleep first
(:func:`elastic_kv_serve.policy.choose_victims`); while none can go, the serving models' KV is shared with
the waiting model (:mod:`.shares`), or, with ``suspend_busy`` and where a share would fall below its floor,
serving models are suspended (:func:`elastic_kv_serve.policy.choose_suspensions`) until the model fits with
its KV share floor too when it wakes to serve (:meth:`.KvShares.serving_floor`: its neighbours still serving
would otherwise fill the KV that the suspension freed, and it would hold none); else the model waits,
until its deadline, for one to become idle. Also the KV pressure of serving models: an idle neighbour
sleeps so that they grow into its memory (:func:`elastic_kv_serve.policy.pressure_victim`); and a serving
model that holds no KV while more models serve than their floors fit takes a turn, as a wake would
(:meth:`RoomMaker.relieve_starvation`). One make-room decision at a time."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable

from elastic_kv_serve import policy
from elastic_kv_serve.errors import ModelUnavailable
from elastic_kv_serve.fleet import Fleet
from elastic_kv_serve.runtime import ModelRuntime, State
from elastic_kv_serve.shares import KvShares
from elastic_kv_serve.sleep import SleepMoves

__all__ = ["NoRoomYet", "RoomMaker"]

logger = logging.getLogger(__name__)


class NoRoomYet(Exception):
    """A suspended model's wake found no room at once; it stays suspended and is tried again later."""


class RoomMaker:
    """Room for the models of one :class:`Fleet` (see the module docstring)."""

    def __init__(self, fleet: Fleet, sleeps: SleepMoves, shares: KvShares) -> None:
        self.fleet = fleet
        self.sleeps = sleeps
        self.shares = shares
        self.lock = asyncio.Lock()  # one make-room decision at a time
        self._starved_since: dict[str, float] = {}  # serving models seen holding no KV, since when

    async def make_room(self, rt: ModelRuntime, deadline: float | None, wait: bool = True) -> None:
        """Put idle models to sleep (or suspend serving ones) until ``rt``'s weights and idle KV fit the
        budget; wait for models to become idle while none can go; ``ModelUnavailable`` at the deadline.
        ``wait=False``: :class:`NoRoomYet` instead of waiting (also while another model makes room)."""
        need = rt.weights_bytes + rt.wake_kv_bytes
        if not wait and self.lock.locked():
            raise NoRoomYet
        async with self.lock:
            rt.has_room = False  # a claim made at start-up is made again here, against what holds now
            try:
                await self._make_room_locked(rt, need, deadline, wait)
            finally:
                self.shares.waiting.pop(rt.name, None)
            # The newcomer's weights leave the budget before it loads, so neighbours' KV cannot take them.
            rt.has_room = True
            self.fleet.sync_budget()

    async def _make_room_locked(
        self, rt: ModelRuntime, need: int, deadline: float | None, wait: bool
    ) -> None:
        """`make_room` under its lock: sleep idle victims, suspend serving ones (where KV shares cannot
        make room), or wait (sharing the serving models' KV with ``rt``)."""
        fleet = self.fleet
        # Where serving models must be suspended for it and requests wait for it: room for its KV floor too.
        serving_need = max(need, rt.weights_bytes + self.shares.serving_floor(rt)) if rt.busy else need
        while True:
            used = fleet.used_bytes(exclude=rt)
            candidates = fleet.awake_candidates(exclude=rt)
            victims = policy.choose_victims(
                candidates, need_bytes=need, used_bytes=used, budget_bytes=fleet.budget_bytes,
                for_priority=rt.config.priority,
            )  # fmt: skip
            if victims is not None:
                for victim in victims:
                    logger.info("model %s sleeps to make room for %s", victim.name, rt.name)
                    await self.sleeps.sleep(fleet.models[victim.name], reason=f"room for {rt.name}")
                if not victims or policy.fits(need, fleet.used_bytes(exclude=rt), fleet.budget_bytes):
                    return
            elif fleet.config.server.suspend_busy and not (wait and self.shares.would_make_room(rt)):
                needs = dict.fromkeys((serving_need, need))  # its KV floor too, else its weights at least
                suspended = await self._suspend_for(rt, needs, self._awake_before(rt, wait))
                if suspended and policy.fits(need, fleet.used_bytes(exclude=rt), fleet.budget_bytes):
                    return
            if not wait:
                raise NoRoomYet
            if deadline is not None and time.monotonic() >= deadline:
                raise ModelUnavailable(
                    f"no memory for model {rt.name}: every model holding it is busy or pinned"
                )
            if victims is None and rt.name not in self.shares.waiting:
                self.shares.waiting[rt.name] = rt  # the serving models' KV is shared with it
                await self.shares.share_kv()
            await asyncio.sleep(fleet.poll_s)
            await fleet.refresh_kv()

    def _awake_before(self, rt: ModelRuntime, wait: bool) -> float:
        """Models awake since this monotonic time or earlier may be suspended for ``rt``: ``min_awake_s``
        ago for a wake that requests wait for; for a suspended model's own wake (``wait=False``), only once
        it has been suspended ``max_suspend_s``, and then models awake at least as long (and ``min_awake_s``):
        each turn lasts at least ``max_suspend_s``, and a model suspended while the others took its place
        at once gets its turn back from them, not only from models awake before its suspension."""
        srv = self.fleet.config.server
        now = time.monotonic()
        if wait:
            return now - srv.min_awake_s
        if now - rt.suspended_since < srv.max_suspend_s:
            return -math.inf
        return now - max(srv.min_awake_s, srv.max_suspend_s)

    def relieve_starvation(self, now: float) -> None:
        """More models serve than their KV share floors fit (they were awake when their requests came), so
        no shares are set, and one of them has held no KV beyond its idle KV for ``min_awake_s``: it takes a
        turn. Serving models are suspended for it as for a wake (:func:`.policy.choose_suspensions`) until
        its floor fits, rather than it waiting for its neighbours' requests to end."""
        fleet = self.fleet
        srv = fleet.config.server
        serving = self.shares.over_floors() if srv.suspend_busy else []
        starved = {r.name for r in serving if r.kv_bytes <= r.idle_kv_bytes}
        self._starved_since = {m: self._starved_since.get(m, now) for m in starved}
        due = [fleet.models[m] for m, since in self._starved_since.items() if now - since >= srv.min_awake_s]
        if not due or self.lock.locked() or fleet.moving():
            return
        rt = min(due, key=lambda r: (-r.config.priority, self._starved_since[r.name]))
        fleet.spawn(self._turn_for(rt), f"turn-{rt.name}")

    async def _turn_for(self, rt: ModelRuntime) -> None:
        """:meth:`relieve_starvation`'s suspensions for ``rt``."""
        fleet = self.fleet
        async with self.lock:
            if rt.state is not State.AWAKE or not rt.busy:
                return
            need = rt.weights_bytes + self.shares.serving_floor(rt)
            await self._suspend_for(rt, [need], time.monotonic() - fleet.config.server.min_awake_s)
            self._starved_since.pop(rt.name, None)

    async def _suspend_for(self, rt: ModelRuntime, needs: Iterable[int], awake_before: float) -> bool:
        """Suspend the serving models (:func:`.policy.choose_suspensions`, those awake since ``awake_before``
        or earlier) that make room for ``rt`` to hold the first of ``needs`` that suspensions can make room
        for; whether any was suspended."""
        fleet = self.fleet
        serving = fleet.awake_candidates(exclude=rt, suspendable=True)
        used = fleet.used_bytes(exclude=rt)
        for need in needs:
            victims = policy.choose_suspensions(
                serving, need_bytes=need, used_bytes=used, budget_bytes=fleet.budget_bytes,
                for_priority=rt.config.priority, awake_before=awake_before,
            )  # fmt: skip
            if victims is not None:
                for victim in victims:
                    await self.sleeps.suspend(fleet.models[victim.name], for_model=rt)
                return bool(victims)
        return False

    def relieve_pressure(self, awake: list[policy.Candidate], now: float) -> None:
        """A serving model's KV grows and has almost filled the budget: put the first idle model to sleep
        (one at a time: none is sleeping or waking now), so that it grows into its memory (:mod:`.policy`)."""
        fleet = self.fleet
        if fleet.moving():
            return
        window = max(fleet.config.server.pressure_idle_s, 4 * fleet.poll_s)
        if not any(r.busy and now - r.kv_grew_at <= window for r in fleet.models.values()):
            return  # no model serving is growing its KV: it needs no room
        victim = policy.pressure_victim(
            awake, used_bytes=fleet.used_bytes(), budget_bytes=fleet.budget_bytes,
            headroom_bytes=fleet.kv_headroom_bytes, now=now, min_idle_s=fleet.config.server.pressure_idle_s,
        )  # fmt: skip
        if victim is not None and not fleet.models[victim.name].lock.locked():
            rt = fleet.models[victim.name]
            fleet.spawn(self.sleeps.idle_sleep(rt, "KV room for the models serving"), f"sleep-{rt.name}")
