"""One served model's live state: :class:`State`, request counters, memory, wake statistics.

A :class:`ModelRuntime` belongs to the server's event loop; only the supervisor changes its state, and
every change wakes whoever waits for one (:meth:`ModelRuntime.wait_change`).

States::

    starting   the engine process is starting (first start or a restart after a failure)
    awake      serving: requests are forwarded to its engine
    sleeping   going to sleep (its engine's sleep API at level 1 or 2, or stopping its process)
    asleep     not serving; a request wakes it (level 1: weights copied back from host memory; level 2:
               reloaded from the checkpoint) or cold-starts it (its process was stopped, or died).
               *Suspended* (``suspended``): put to sleep while it served, to make room for another model;
               its engine keeps the requests it was serving, which resume once it wakes
    waking     waking up for a request (or making room first)
    failed     its engine died or could not start; restarted with back-off, requests wait for it
    stopped    the server is shutting down or gave up restarting it; requests get 503

The moves between them are :data:`TRANSITIONS`; :meth:`ModelRuntime.set_state` refuses any other
(:class:`InvalidTransition`: a bug in the supervisor, never a user's error).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from elastic_kv_serve.config import ModelConfig
from elastic_kv_serve.engines import EngineProcess
from elastic_kv_serve.kinds import SleepMode

__all__ = ["TRANSITIONS", "InvalidTransition", "ModelRuntime", "State", "Transition", "quantile"]


class State(str, Enum):
    STARTING = "starting"
    AWAKE = "awake"
    SLEEPING = "sleeping"
    ASLEEP = "asleep"
    WAKING = "waking"
    FAILED = "failed"
    STOPPED = "stopped"


# State -> the states it may move to (besides staying). Any state may fail or stop; the rest is the life
# cycle: started or woken (or left asleep when no room came in time), put to sleep (or kept awake when its
# engine refused a suspension), restarted after a failure.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.ASLEEP: frozenset({State.STARTING, State.WAKING, State.FAILED, State.STOPPED}),
    State.STARTING: frozenset({State.AWAKE, State.ASLEEP, State.FAILED, State.STOPPED}),
    State.WAKING: frozenset({State.AWAKE, State.ASLEEP, State.FAILED, State.STOPPED}),
    State.AWAKE: frozenset({State.SLEEPING, State.FAILED, State.STOPPED}),
    State.SLEEPING: frozenset({State.ASLEEP, State.AWAKE, State.FAILED, State.STOPPED}),
    State.FAILED: frozenset({State.STARTING, State.STOPPED}),
    State.STOPPED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A move between two states that :data:`TRANSITIONS` does not allow."""


# States in which a model holds no weights on the device and has no room reserved for them.
WITHOUT_WEIGHTS = frozenset({State.ASLEEP, State.FAILED, State.STOPPED})


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank), ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class Transition:
    """One start, wake or sleep of a model, as ``/status`` lists it."""

    kind: str  # "start", "wake", "sleep", "suspend" (a sleep while serving) or "resume" (its wake)
    level: str  # "1" or "2" (through the engine's API), "cold" (a process started), "stop"
    seconds: float  # the whole transition, as the request that waited for it saw it
    room_seconds: float  # of which: putting other models to sleep to make room (wakes and starts)
    at: float  # wall-clock time it ended
    kept: int = 0  # a suspension: the requests its engine kept
    parked_bytes: int = 0  # a suspension: the KV its engine parked in host memory for them

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "level": self.level, "seconds": round(self.seconds, 4),
                "room_seconds": round(self.room_seconds, 4), "at": self.at, "kept": self.kept,
                "parked_bytes": self.parked_bytes}  # fmt: skip


@dataclass(eq=False)
class ModelRuntime:
    """A model's configuration plus everything the server knows about it now."""

    config: ModelConfig
    idle_sleep_s: float
    weights_bytes: int
    sleep_mode: SleepMode = "stop"
    state: State = State.ASLEEP
    engine: EngineProcess | None = None
    in_flight: int = 0
    queued: int = 0
    last_used: float = field(default_factory=time.monotonic)
    last_used_wall: float | None = None
    kv_bytes: int = 0
    kv_grew_at: float = -math.inf  # monotonic time its KV was last seen larger than the reading before
    idle_kv_bytes: int = 0  # KV it held when last seen idle: what waking it needs besides its weights
    # KV its engine parked in host memory when it was suspended: still charged on its pool's records, not
    # on the device; its wake maps it back (0: none parked)
    parked_kv_bytes: int = 0
    kv_limit_bytes: int | None = None  # its KV share, set as its pool's limit while KV is shared
    # Its weights count against the budget: set once room was made for them (before they load), cleared
    # when it sleeps or fails. A model that waits for room is not counted, or two models waking at once
    # would each wait for the room the other one's claim takes.
    has_room: bool = False
    wakes: int = 0
    sleeps: int = 0
    restarts: int = 0
    failures: int = 0  # consecutive failed starts or deaths; reset once it serves
    start_cause: str | None = None  # why its last start failed (the engine log's line), until it serves
    error: str | None = None
    wake_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    sleep_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    transitions: deque[Transition] = field(default_factory=lambda: deque(maxlen=1000))
    # The level of the sleep it is in: 1 or 2 (its engine sleeps), None (awake, or its process is gone).
    sleep_level: int | None = None
    host_bytes: int = 0  # host memory its asleep weights take (read from the host arena)
    # what its level-1 sleep takes of the arena: the engine's word once it is up, then its last sleep's (0:
    # not known yet)
    host_need_bytes: int = 0
    awake_since: float = math.inf  # monotonic time it last became awake (inf: not awake yet)
    # Suspended: asleep with the requests it was serving kept in its engine (they resume when it wakes).
    suspended: bool = False
    suspended_since: float = math.inf  # monotonic time of its suspension
    suspends: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one transition at a time
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def requests(self) -> int:
        """Its requests in flight or queued."""
        return self.in_flight + self.queued

    @property
    def busy(self) -> bool:
        return self.requests > 0

    @property
    def level_one_bytes(self) -> int:
        """What a level-1 sleep of it takes of the host arena: as measured or told, else its weights'."""
        return self.host_need_bytes or self.weights_bytes

    @property
    def device_kv_bytes(self) -> int:
        """Its KV on the device, or with room reserved there: what its pools are charged, less what it
        parked in host memory while it has no room (suspended)."""
        return self.kv_bytes - (0 if self.has_room else min(self.parked_kv_bytes, self.kv_bytes))

    @property
    def wake_kv_bytes(self) -> int:
        """The KV its wake needs room for besides its weights: what it held idle, or what it parked."""
        return max(self.idle_kv_bytes, self.parked_kv_bytes)

    @property
    def footprint_bytes(self) -> int:
        """What it holds (or has room reserved for) on the device now: its weights, plus its KV."""
        return (self.weights_bytes if self.has_room else 0) + self.device_kv_bytes

    def set_state(self, state: State, error: str | None = None) -> None:
        """Move to ``state`` (:data:`TRANSITIONS`, else :class:`InvalidTransition`) and wake everyone
        waiting for a change."""
        if state is not self.state and state not in TRANSITIONS[self.state]:
            raise InvalidTransition(f"model {self.name}: {self.state.value} -> {state.value}")
        self.state = state
        self.error = error
        if state in WITHOUT_WEIGHTS:
            self.has_room = False
        self.notify()

    def notify(self) -> None:
        """Wake everyone waiting for a change (a state, or a request slot that freed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout_s: float) -> bool:
        """Wait for the next change (:meth:`notify`); False if ``timeout_s`` passed first."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True

    def record(
        self,
        kind: str,
        level: str,
        seconds: float,
        room_seconds: float = 0.0,
        *,
        kept: int = 0,
        parked: int = 0,
    ) -> None:
        """Remember one transition (``/status`` shows them; wake and sleep times feed the quantiles)."""
        self.transitions.append(Transition(kind, level, seconds, room_seconds, time.time(), kept, parked))
        if kind in ("wake", "resume"):
            self.wakes += 1
            self.wake_seconds.append(seconds)
        elif kind in ("sleep", "suspend"):
            self.sleeps += 1
            self.sleep_seconds.append(seconds)
        if kind == "suspend":
            self.suspends += 1

    def touch(self) -> None:
        self.last_used = time.monotonic()
        self.last_used_wall = time.time()

    def status(self) -> dict[str, Any]:
        """The ``/status`` entry of this model (JSON-ready)."""
        waits, sleeps = list(self.wake_seconds), list(self.sleep_seconds)
        return {
            "name": self.name,
            "engine": self.config.engine,
            "model": self.config.model,
            "state": self.state.value,
            "sleep_mode": self.sleep_mode,
            "pid": self.engine.pid if self.engine is not None and self.engine.alive() else None,
            "port": self.engine.port if self.engine is not None and self.engine.alive() else None,
            "pool": self.config.pool_name,
            "priority": self.config.priority,
            "pinned": self.config.pinned,
            "idle_sleep_s": self.idle_sleep_s,
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "parked_kv_bytes": self.parked_kv_bytes,
            "kv_limit_bytes": self.kv_limit_bytes,
            "footprint_bytes": self.footprint_bytes,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "last_used": self.last_used_wall,
            "wakes": self.wakes,
            "sleeps": self.sleeps,
            "restarts": self.restarts,
            "wake_p50_s": quantile(waits, 0.5),
            "wake_p99_s": quantile(waits, 0.99),
            "sleep_p50_s": quantile(sleeps, 0.5),
            "sleep_p99_s": quantile(sleeps, 0.99),
            "sleep_level": self.sleep_level,
            "suspended": self.suspended,
            "suspends": self.suspends,
            "host_bytes": self.host_bytes,
            "transitions": [t.as_dict() for t in self.transitions],
            "error": self.error,
            "log": str(self.engine.log_path) if self.engine is not None else None,
        }
