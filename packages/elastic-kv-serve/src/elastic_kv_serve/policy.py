"""Who sleeps when memory is short, and who sleeps because it is idle: pure functions over plain facts.

The device budget covers every awake model's footprint (weights + KV). A model that must wake needs its
weights plus the KV it holds while idle; when that does not fit next to the awake models, idle models are
put to sleep first in the order *lowest priority, then least recently used*. A model is never put to
sleep for a model of lower priority, nor while it is pinned or serving requests (in flight or queued).

KV pressure: awake models that serve grow their KV into the budget; when what is left of it falls below the
server's ``kv_headroom`` while some model serves, the idle model that would go first (same order) sleeps, once
it has been idle ``pressure_idle_s`` -- busy models get its memory without waiting for its ``idle_sleep_s``.

KV shares: when a model must wake and no idle model can make room (every awake model serves), or two or more
models serve and the budget is nearly full, the serving models' KV is shared: each of them, and each model
waiting for room, gets a share of the KV room the budget leaves beside the weights and the KV of the models
that are not shared (idle, pinned), in proportion to its requests (in flight and queued; rounded down to a
power of two, so that the shares move a few times in a burst rather than with each request), enforced as a
pool limit: a model with most of the requests gets most of the KV, not a slice equal to that of a neighbour
with two. A model above its share drains to it (its engine preempts requests, which resume when memory frees);
one below may grow to it. A model waiting for room thus wakes in about the time its neighbours take to drain,
not when one of them goes idle. A share has a floor (:func:`share_floor`): no claimant gets less (those whose
part of the room would be less get the floor, the others split the rest in proportion), and when the floor for
every claimant does not fit in the room the models would rather take turns (suspension); so do models that
already serve when it does not fit (awake when their requests came): one that has held no KV for
``min_awake_s`` has serving models suspended for it as a wake would. The floor can follow
the models' weights: each decode step of a model reads all of its weights whatever its batch, so models that
share the device's memory bandwidth serve the most tokens with the fewest of them awake, each with KV for a
large batch, rather than many awake with little KV each.

Suspension: when more models serve than fit awake (no idle model can go, and a KV share would fall below its
floor), a model waiting to wake suspends serving ones: they sleep with their requests kept in their engines,
which resume them when they wake (the vLLM plugin parks their KV in host memory meanwhile, so they go on where
they were instead of being computed again; the fleet counts parked KV off the device). As many are suspended
as make room for the waking model's weights and, when requests wait for it, its KV share floor: room for its
weights alone would let the models still serving take the KV that the suspension freed. Only a model awake for
some time (``awake_before``) is suspended, lowest priority first, then the one with the fewest requests (a
suspension pauses every request of its model: those not started yet lose their time to the first token), then
the one awake longest; never a pinned one, one of higher priority, or one whose engine cannot keep its
requests asleep. A suspended model wakes again once room is free, or once it has waited long enough to suspend
in turn a model awake at least as long: serving models take turns, each awake for at least that long, and none
waits without end.

Host arena: level-1 copies are kept for the models used most recently. A model going to sleep whose copy
does not fit in the arena takes the extents of asleep models that come before it in the order *lower
priority, then less recently used*: they are demoted to level 2 (their next wake reloads the weights), the
first in that order first, until its copy fits. Otherwise it sleeps at level 2 itself. A model put to sleep
to make room writes its copy before the model it makes room for wakes and gives its own back, so swaps stay
at level 1 only while the arena holds one copy more than the models asleep at once
(:func:`arena_shortfall`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Candidate",
    "arena_shortfall",
    "choose_suspensions",
    "choose_victims",
    "demotion_order",
    "due_to_sleep",
    "fits",
    "kv_shares",
    "pressure_victim",
    "share_floor",
]


@dataclass(frozen=True, slots=True)
class Candidate:
    """An awake model as the policy sees it."""

    name: str
    priority: int
    last_used: float  # monotonic seconds of its last request's end (or of waking)
    footprint_bytes: int  # weights + KV it holds now
    pinned: bool = False
    requests: int = 0  # requests in flight or queued
    idle_sleep_s: float = 0.0  # 0 = never sleeps when idle
    awake_since: float = 0.0  # monotonic seconds it last became awake
    suspendable: bool = False  # its engine can sleep while serving, keeping its requests

    @property
    def busy(self) -> bool:
        """It serves: requests in flight or queued."""
        return self.requests > 0


def fits(need_bytes: int, used_bytes: int, budget_bytes: int | None) -> bool:
    """True when ``need_bytes`` more fit beside ``used_bytes`` (always, without a budget)."""
    return budget_bytes is None or used_bytes + need_bytes <= budget_bytes


def choose_victims(
    candidates: Iterable[Candidate],
    *,
    need_bytes: int,
    used_bytes: int,
    budget_bytes: int | None,
    for_priority: int,
) -> list[Candidate] | None:
    """The models to put to sleep so that ``need_bytes`` fit, in the order they should go.

    ``[]`` when it fits already; ``None`` when even every eligible model asleep would not make room (the
    caller waits for models to become idle, or gives up). Eligible: not pinned, not busy, priority at most
    ``for_priority``. Order: lowest priority first, then least recently used.
    """
    eligible = sorted(
        (c for c in candidates if not c.pinned and not c.busy and c.priority <= for_priority),
        key=lambda c: (c.priority, c.last_used),
    )
    return _until_fits(eligible, need_bytes, used_bytes, budget_bytes)


def choose_suspensions(
    candidates: Iterable[Candidate],
    *,
    need_bytes: int,
    used_bytes: int,
    budget_bytes: int | None,
    for_priority: int,
    awake_before: float,
) -> list[Candidate] | None:
    """The serving models to suspend so that ``need_bytes`` fit (see the module docstring), in order.

    ``[]`` when it fits already; ``None`` when suspending every eligible model would not make room.
    Eligible: busy, suspendable, not pinned, priority at most ``for_priority``, awake since
    ``awake_before`` or earlier. Order: lowest priority first, then fewest requests, then awake longest."""
    eligible = sorted(
        (
            c
            for c in candidates
            if c.busy and c.suspendable and not c.pinned and c.priority <= for_priority
            and c.awake_since <= awake_before
        ),
        key=lambda c: (c.priority, c.requests, c.awake_since),
    )  # fmt: skip
    return _until_fits(eligible, need_bytes, used_bytes, budget_bytes)


def _until_fits(
    ordered: list[Candidate], need_bytes: int, used_bytes: int, budget_bytes: int | None
) -> list[Candidate] | None:
    """The shortest head of ``ordered`` whose footprints make room for ``need_bytes`` (``[]``: it fits
    already; ``None``: all of them would not)."""
    used = used_bytes
    for taken in range(len(ordered) + 1):
        if fits(need_bytes, used, budget_bytes):
            return ordered[:taken]
        if taken < len(ordered):
            used -= ordered[taken].footprint_bytes
    return None


def demotion_order(asleep: Iterable[Candidate], *, priority: int, last_used: float) -> list[Candidate]:
    """The asleep level-1 models a model of ``priority``, last used at ``last_used``, may demote to make room
    for its own copy (see the module docstring), in the order to demote them: those of lower priority, and
    those of equal priority used less recently; busy (suspended) ones never."""
    return sorted(
        (c for c in asleep if not c.busy and (c.priority, c.last_used) < (priority, last_used)),
        key=lambda c: (c.priority, c.last_used),
    )


def arena_shortfall(
    arena_bytes: int, copies: Sequence[int], footprints: Sequence[int], budget_bytes: int | None
) -> int:
    """The bytes the host arena lacks for every swap to stay at level 1 (0: none) when all the models want
    to be awake: each model's level-1 copy (``copies``) and device footprint when awake and idle
    (``footprints``, in the same order), the device budget (``None``: all stay awake, no swap). As many
    models as fit are awake, the smallest first; the others are asleep, and a swap needs one copy more (see
    the module docstring): the largest copies of that many models."""
    if budget_bytes is None:
        return 0
    awake, used = 0, 0
    for footprint in sorted(footprints):
        if used + footprint > budget_bytes:
            break
        used += footprint
        awake += 1
    asleep = len(copies) - awake
    if asleep == 0:
        return 0
    need = sum(sorted(copies, reverse=True)[: asleep + 1])
    return max(0, need - arena_bytes)


def due_to_sleep(candidates: Sequence[Candidate], now: float) -> list[Candidate]:
    """Awake models idle for at least their ``idle_sleep_s`` (0 = never), pinned and busy ones excluded."""
    return [
        c
        for c in candidates
        if c.idle_sleep_s > 0 and not c.pinned and not c.busy and now - c.last_used >= c.idle_sleep_s
    ]


def pressure_victim(
    candidates: Sequence[Candidate],
    *,
    used_bytes: int,
    budget_bytes: int | None,
    headroom_bytes: int,
    now: float,
    min_idle_s: float,
) -> Candidate | None:
    """The idle model to put to sleep for KV pressure (see the module docstring), or ``None``: no budget, no
    model serving, the budget's room at least ``headroom_bytes``, or no model idle long enough."""
    if budget_bytes is None or headroom_bytes <= 0 or not any(c.busy for c in candidates):
        return None
    if budget_bytes - used_bytes >= headroom_bytes:
        return None
    eligible = [c for c in candidates if not c.pinned and not c.busy and now - c.last_used >= min_idle_s]
    return min(eligible, key=lambda c: (c.priority, c.last_used), default=None)


def share_floor(min_bytes: int, weights_ratio: float, weights: Iterable[int], idle: Iterable[int]) -> int:
    """The least KV share the serving and waiting models may be cut to: ``min_bytes``, ``weights_ratio`` x
    the largest of their ``weights``, and the most any of them holds ``idle`` (below that, cutting it makes no
    room)."""
    return max(min_bytes, int(weights_ratio * max(weights, default=0)), *idle)


def kv_shares(room_bytes: int, demands: Sequence[int], floor_bytes: int = 0) -> list[int] | None:
    """Each claimant's share of ``room_bytes`` of KV, in proportion to its ``demands`` (its requests, rounded
    down to a power of two; see the module docstring): none below ``floor_bytes`` -- a claimant whose part
    would be less gets the floor and the others split what is left in proportion -- and none below 1 byte
    (a pool limit of 0 would mean none). ``None`` when the floor for every claimant does not fit."""
    if not demands:
        raise ValueError("a share needs at least one claimant")
    if any(d < 0 for d in demands):
        raise ValueError(f"a demand is a count of requests, got {list(demands)}")
    floor = max(floor_bytes, 1)
    if floor_bytes > 0 and len(demands) * floor_bytes > room_bytes:
        return None
    if room_bytes < len(demands):  # no room at all: the least limit a pool can have, each
        return [1] * len(demands)
    # A claimant counts once even with no request yet; counts are rounded down to a power of two, so that
    # shares move a few times in a burst, not with each request (a share cut below a model's use preempts).
    weights = [1 << (max(d, 1).bit_length() - 1) for d in demands]
    at_floor: set[int] = set()
    while True:  # those under the floor take it; the rest share what is left (each pass fixes at least one)
        rest = [i for i in range(len(weights)) if i not in at_floor]
        left = room_bytes - floor * len(at_floor)
        total = sum(weights[i] for i in rest)
        parts = {i: left * weights[i] // total for i in rest}
        under = {i for i, part in parts.items() if part < floor}
        if not under or len(under) == len(rest):
            break
        at_floor |= under
    return [floor if i in at_floor else max(parts[i], floor) for i in range(len(weights))]
