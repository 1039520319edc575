"""KV shares (:mod:`elastic_kv_serve.policy`, "KV shares"): while models wait for room, or two or more serve
with less than ``kv_headroom`` of the budget left, each serving model's pool takes a share of the KV room
in proportion to its requests as its limit, and so does each waiting model's claim; sharing ends when no
model waits and at most one serves. A pool that takes no limit (SGLang's named parts, or an engine that
refuses it) is left out until its engine starts again."""

from __future__ import annotations

import asyncio
import logging

from elastic_kv.registry import UNLIMITED, LimitNotFollowedError, UnknownPoolError

from elastic_kv_serve import policy
from elastic_kv_serve.fleet import Fleet
from elastic_kv_serve.runtime import ModelRuntime, State

__all__ = ["KvShares"]

logger = logging.getLogger(__name__)


class KvShares:
    """The serving models' KV shares of one :class:`Fleet` (see the module docstring)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.waiting: dict[str, ModelRuntime] = {}  # models waiting for room no idle model can make
        self._sharing = False  # the serving models' KV is shared now
        self._lock = asyncio.Lock()  # one shares decision at a time (the monitor and waiting wakes)

    async def share_kv(self) -> None:
        """Set, move or lift the serving models' KV shares (see the module docstring)."""
        async with self._lock:
            await self._share_kv_locked()

    def _share_plan(self, waiting: list[ModelRuntime]) -> tuple[list[ModelRuntime], dict[str, int] | None]:
        """The serving models whose KV would be shared with ``waiting``, and each claimant's share by name
        (``None``: no budget, or the floor for every claimant does not fit)."""
        fleet = self.fleet
        budget = fleet.budget_bytes
        top = max((w.config.priority for w in waiting), default=None)
        shared = [
            r for r in fleet.models.values()
            if r.state is State.AWAKE and r.busy and r.has_room and not r.config.pinned
            and r.name not in fleet.unshareable and (top is None or r.config.priority <= top)
        ]  # fmt: skip
        if budget is None or not shared:
            return shared, None
        weights = sum(r.weights_bytes for r in fleet.models.values() if r.has_room)
        fixed = sum(r.device_kv_bytes for r in fleet.models.values() if r not in shared)
        room = budget - weights - sum(w.weights_bytes for w in waiting) - fixed
        # Below kv_share_min a model's own requests may not fit its share (two such models would wait for
        # each other), below what a model holds idle it makes no room: wait for an idle neighbour, or take
        # turns (suspension).
        claimants = [*shared, *waiting]
        floor = policy.share_floor(
            fleet.kv_share_min_bytes, fleet.config.server.kv_share_min_weights,
            (r.weights_bytes for r in claimants), (r.idle_kv_bytes for r in claimants),
        )  # fmt: skip
        shares = policy.kv_shares(room, [r.requests for r in claimants], floor)
        return shared, None if shares is None else {r.name: s for r, s in zip(claimants, shares, strict=True)}

    def serving_floor(self, rt: ModelRuntime) -> int:
        """The least KV ``rt`` serves with: its own share floor (at least what it holds idle)."""
        return policy.share_floor(
            self.fleet.kv_share_min_bytes, self.fleet.config.server.kv_share_min_weights,
            [rt.weights_bytes], [rt.idle_kv_bytes],
        )  # fmt: skip

    def over_floors(self) -> list[ModelRuntime]:
        """The serving models, when more of them serve than their KV share floors fit beside one another
        while no model waits for room (they were awake when their requests came); else none."""
        if self.waiting or self.fleet.budget_bytes is None:
            return []
        shared, shares = self._share_plan([])
        return shared if len(shared) >= 2 and shares is None else []

    def would_make_room(self, rt: ModelRuntime) -> bool:
        """Whether sharing the serving models' KV with ``rt`` (waiting) would make room for it."""
        waiting = list(self.waiting.values())
        _, shares = self._share_plan(waiting if rt in waiting else [*waiting, rt])
        return shares is not None

    async def _share_kv_locked(self) -> None:
        fleet = self.fleet
        budget = fleet.budget_bytes
        waiting = list(self.waiting.values())
        shared, shares = self._share_plan(waiting)
        if budget is None or (not waiting and len(shared) < 2):
            self._sharing = False
        elif waiting or budget - fleet.used_bytes() < fleet.kv_headroom_bytes:
            self._sharing = True
        limits = {r.name: shares[r.name] for r in shared} if self._sharing and shares is not None else {}
        for rt in fleet.models.values():
            want = limits.get(rt.name)
            have = rt.kv_limit_bytes
            if want == have or (want and have and abs(want - have) * 32 < have):
                continue  # unchanged, or moved by less than 1/32: each change may preempt requests
            await asyncio.to_thread(self._set_kv_limit, rt, want)

    def _set_kv_limit(self, rt: ModelRuntime, limit: int | None) -> None:
        """Put ``rt``'s KV share on its pool (``None``: lift it)."""
        try:
            self.fleet.registry.set_limit(rt.config.pool_name, UNLIMITED if limit is None else limit)
        except UnknownPoolError:
            if limit is not None:  # no pool of that name: SGLang's hybrid pools come as named parts
                self.fleet.unshareable.add(rt.name)
            rt.kv_limit_bytes = None
            return
        except LimitNotFollowedError as exc:
            logger.warning("model %s: its KV is not shared: %s", rt.name, exc)
            self.fleet.unshareable.add(rt.name)
            rt.kv_limit_bytes = None
            return
        rt.kv_limit_bytes = limit
        if limit is None:
            logger.info("model %s: KV share lifted", rt.name)
        else:
            logger.info("model %s: KV share %d bytes (holds %d)", rt.name, limit, rt.kv_bytes)
