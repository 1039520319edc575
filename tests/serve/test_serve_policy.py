"""The sleep manager's policy without engines: who makes room, in which order, and who sleeps when idle."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from elastic_kv_serve.policy import (
    Candidate,
    arena_shortfall,
    choose_suspensions,
    choose_victims,
    demotion_order,
    due_to_sleep,
    fits,
    kv_shares,
    pressure_victim,
)

MiB = 1 << 20


def _c(name: str, prio: int, used: float, size: int, **kw: object) -> Candidate:
    return Candidate(name, prio, used, size * MiB, **kw)  # type: ignore[arg-type]


def test_fits() -> None:
    assert fits(10, 90, 100) and not fits(11, 90, 100) and fits(10**12, 10**12, None)


def test_nothing_to_do_when_it_fits() -> None:
    one = [_c("a", 0, 1, 50)]
    victims = choose_victims(one, need_bytes=10 * MiB, used_bytes=50 * MiB, budget_bytes=100 * MiB,
                             for_priority=0)  # fmt: skip
    assert victims == []


def test_lowest_priority_then_least_recently_used_goes_first() -> None:
    models = [_c("hi-old", 5, 1.0, 30), _c("lo-new", 0, 9.0, 30), _c("lo-old", 0, 2.0, 30)]
    victims = choose_victims(
        models, need_bytes=30 * MiB, used_bytes=90 * MiB, budget_bytes=100 * MiB, for_priority=5
    )
    assert [v.name for v in victims or []] == ["lo-old"]
    victims = choose_victims(
        models, need_bytes=60 * MiB, used_bytes=90 * MiB, budget_bytes=100 * MiB, for_priority=5
    )
    assert [v.name for v in victims or []] == ["lo-old", "lo-new"]


def test_pinned_busy_and_higher_priority_models_stay() -> None:
    models = [_c("pinned", 0, 1, 40, pinned=True), _c("busy", 0, 2, 40, requests=1), _c("vip", 9, 3, 40)]
    assert choose_victims(models, need_bytes=40 * MiB, used_bytes=120 * MiB, budget_bytes=130 * MiB,
                          for_priority=1) is None  # fmt: skip
    victims = choose_victims(
        models, need_bytes=40 * MiB, used_bytes=120 * MiB, budget_bytes=130 * MiB, for_priority=9
    )
    assert [v.name for v in victims or []] == ["vip"]


def test_impossible_requests_answer_none() -> None:
    one = [_c("a", 0, 1, 10)]
    victims = choose_victims(one, need_bytes=500 * MiB, used_bytes=10 * MiB, budget_bytes=100 * MiB,
                             for_priority=0)  # fmt: skip
    assert victims is None


def test_idle_models_due_to_sleep() -> None:
    models = [
        _c("idle", 0, 0.0, 1, idle_sleep_s=10.0),
        _c("recent", 0, 95.0, 1, idle_sleep_s=10.0),
        _c("never", 0, 0.0, 1, idle_sleep_s=0.0),
        _c("pinned", 0, 0.0, 1, idle_sleep_s=10.0, pinned=True),
        _c("busy", 0, 0.0, 1, idle_sleep_s=10.0, requests=1),
    ]
    assert [c.name for c in due_to_sleep(models, now=100.0)] == ["idle"]


def test_kv_pressure_sleeps_the_first_idle_model_once_it_has_idled_long_enough() -> None:
    models = [
        _c("serving", 0, 99.0, 60, requests=1),
        _c("idle-old", 0, 90.0, 20),
        _c("idle-new", 0, 99.5, 20),
        _c("pinned", 0, 10.0, 10, pinned=True),
    ]

    def victim(
        used: int, *, budget: int | None = 112, min_idle: float = 1.0, group: list[Candidate] = models
    ) -> str | None:
        found = pressure_victim(
            group, used_bytes=used * MiB, budget_bytes=None if budget is None else budget * MiB,
            headroom_bytes=5 * MiB, now=100.0, min_idle_s=min_idle,
        )  # fmt: skip
        return None if found is None else found.name

    assert victim(110) == "idle-old"  # 2 MiB left < 5 MiB of headroom
    assert victim(107) is None  # 5 MiB left: enough
    assert victim(110, min_idle=20.0) is None  # nobody idle that long
    assert victim(110, budget=None) is None  # no budget, no pressure
    assert victim(110, group=models[1:]) is None  # nothing serving: nothing grows
    with_prio = [*models, _c("low", -1, 95.0, 10)]
    assert victim(110, group=with_prio) == "low"  # lowest priority first, as for room


def test_two_models_waking_at_once_do_not_wait_for_each_others_claim(tmp_path: Path) -> None:
    """Both asleep, room for one: the first to make room gets it; the second is refused at its deadline
    instead of both waiting on weights that neither has loaded (the claim of a model still waiting for
    room does not count against the budget)."""
    from elastic_kv_serve.config import parse_config
    from elastic_kv_serve.errors import ModelUnavailable
    from elastic_kv_serve.runtime import State
    from elastic_kv_serve.supervisor import Supervisor

    config = parse_config(
        {
            "server": {"registry_dir": str(tmp_path / "reg"), "log_dir": str(tmp_path / "logs"),
                       "budget": "15M"},
            "models": [
                {"name": n, "engine": "vllm", "model": str(tmp_path / n), "weights_bytes": "10M"}
                for n in ("a", "b")
            ],
        }
    )  # fmt: skip

    async def scenario() -> None:
        sup = Supervisor(config, poll_s=0.01)
        a, b = sup.fleet.models["a"], sup.fleet.models["b"]
        try:
            a.set_state(State.WAKING)  # both claimed by requests, neither loaded
            b.set_state(State.WAKING)
            await sup.room.make_room(a, deadline=time.monotonic() + 5)
            assert a.has_room and not b.has_room
            assert sup.fleet.used_bytes() == 10 * MiB
            with pytest.raises(ModelUnavailable):
                await sup.room.make_room(b, deadline=time.monotonic() + 0.1)
            assert not b.has_room
            a.set_state(State.ASLEEP)
            assert not a.has_room and sup.fleet.used_bytes() == 0
        finally:
            await sup.fleet.client.aclose()

    asyncio.run(scenario())


def test_a_vllm_model_with_random_weights_never_sleeps_at_level_2(tmp_path: Path) -> None:
    """vLLM reloads weights from the checkpoint: with ``--load-format dummy`` there is none, so when the
    arena has no room the sleep is a stop, not a level-2 sleep whose wake would fail."""
    from elastic_kv_serve.config import ModelConfig
    from elastic_kv_serve.host import HostMemory
    from elastic_kv_serve.kinds import VllmKind

    real = ModelConfig(name="real", model="/m")
    dummy = ModelConfig(name="dummy", model="/m", args=["--load-format", "dummy"])
    kind = VllmKind()
    assert kind.levels_for(real) == (1, 2) and kind.levels_for(dummy) == (1,)
    host = HostMemory(4 * MiB, tmp_path)
    host.create_arena()
    try:
        assert host.level_for(kind, dummy, 2 * MiB) == 1  # the copy fits the arena
        assert host.level_for(kind, real, 64 * MiB) == 2 and host.level_for(kind, dummy, 64 * MiB) == 0
    finally:
        host.close()


def test_arena_copies_go_to_models_used_more_recently_or_of_higher_priority() -> None:
    asleep = [_c("lo-new", 0, 9.0, 10), _c("mid-old", 1, 1.0, 10), _c("mid-older", 1, 0.5, 10),
              _c("mid-new", 1, 8.0, 10), _c("hi-old", 2, 0.1, 10),
              _c("mid-kept", 1, 0.2, 10, requests=1)]  # fmt: skip
    order = demotion_order(asleep, priority=1, last_used=5.0)
    # lower priority first whatever its use, then the same priority least recently used first; never a
    # model of higher priority, one used after the sleeper, or one that keeps requests (suspended)
    assert [c.name for c in order] == ["lo-new", "mid-older", "mid-old"]
    assert demotion_order(asleep, priority=0, last_used=1.0) == []


@pytest.mark.parametrize(
    ("arena", "copies", "footprints", "budget", "short"),
    [
        # the H100 run: 8 models of 16.5 GiB (13.65 GiB copies), 4 awake: 4 asleep + the swap's spare
        (629, [137] * 8, [165] * 8, 717, 5 * 137 - 629),
        (5 * 137, [137] * 8, [165] * 8, 717, 0),
        (10, [10] * 3, [10] * 3, 20, 10),  # two awake, one asleep: two copies for a swap
        (10, [10] * 3, [10] * 3, 30, 0),  # all awake: no swap
        (10, [10] * 3, [10] * 3, None, 0),  # no budget: no swap
        (25, [10, 20, 5], [10, 20, 5], 15, 5),  # the smallest awake (5 + 10), the two largest copies: 30
        (0, [0, 0], [10, 10], 10, 0),  # models that do not sleep into the arena need no copy
    ],
)
def test_the_arena_needs_one_copy_more_than_the_models_asleep_when_as_many_as_fit_are_awake(
    arena: int, copies: list[int], footprints: list[int], budget: int | None, short: int
) -> None:
    assert arena_shortfall(arena, copies, footprints, budget) == short


def test_a_random_weights_vllm_model_is_never_demoted() -> None:
    from elastic_kv_serve.config import ModelConfig
    from elastic_kv_serve.kinds import CommandKind, VllmKind

    assert VllmKind().can_demote(ModelConfig(name="real", model="/m"))
    assert not VllmKind().can_demote(ModelConfig(name="d", model="/m", args=["--load-format=dummy"]))
    command = {"name": "c", "model": "/m", "engine": "command", "command": ["s", "{port}"]}
    assert not CommandKind().can_demote(ModelConfig(**command, sleep_path="/s", wake_path="/w"))
    assert CommandKind().can_demote(ModelConfig(**command, sleep_path="/s", wake_path="/w", demote_path="/d"))


def test_a_vllm_engine_says_what_its_level_1_sleep_takes_of_the_arena_once_it_is_up() -> None:
    # vLLM's dev-mode /collective_rpc answers one result a worker; each rank sleeps its own weights.
    import httpx
    from elastic_kv_serve.kinds import VllmKind

    asked: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.content)
        ranks = [{"pinned_bytes": 8, "seconds": 0.1, "level_one_bytes": n} for n in (3 << 30, 5 << 30)]
        return httpx.Response(200, json={"results": ranks})

    async def main() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            with_arena = await VllmKind().after_start(client, "http://engine", arena=True)
            without = await VllmKind().after_start(client, "http://engine", arena=False)
            return with_arena, without

    assert asyncio.run(main()) == (8 << 30, 0)
    assert asked == [b'{"method":"elastic_kv_pin_host"}']  # only with an arena: nothing to pin or plan


def test_a_share_floor_follows_the_largest_weights_where_asked() -> None:
    from elastic_kv_serve.policy import share_floor

    gib = 1 << 30
    weights, idle = [16 * gib, 8 * gib], [gib // 4, gib // 2]
    assert share_floor(gib, 0.0, weights, idle) == gib  # kv_share_min alone
    assert share_floor(gib, 0.5, weights, idle) == 8 * gib  # half the largest weights
    assert share_floor(gib, 0.01, weights, [3 * gib]) == 3 * gib  # never below what a model holds idle
    assert share_floor(0, 0.5, [], []) == 0


def test_kv_shares_split_the_room_in_proportion_to_requests_and_never_reach_zero() -> None:
    assert kv_shares(30 * MiB, [1, 1, 1]) == [10 * MiB] * 3  # equal requests, equal shares
    assert kv_shares(40 * MiB, [1, 3]) == [MiB * 40 // 3, MiB * 80 // 3]  # 3 counts as 2: a power of two
    assert kv_shares(50 * MiB, [1, 4]) == [10 * MiB, 40 * MiB]
    assert kv_shares(50 * MiB, [2, 15]) == kv_shares(50 * MiB, [3, 8])  # shares move at 2, 4, 8, 16, ...
    assert kv_shares(30 * MiB, [0, 2]) == [10 * MiB, 20 * MiB]  # a claimant with no request yet counts once
    assert kv_shares(10, [1, 1, 1]) == [3, 3, 3]  # whole bytes, rounded down
    # no room at all: the least limit a pool can have (0 is none)
    assert kv_shares(-5 * MiB, [1, 4]) == [1, 1]
    with pytest.raises(ValueError, match="at least one claimant"):
        kv_shares(MiB, [])
    with pytest.raises(ValueError, match="count of requests"):
        kv_shares(MiB, [1, -1])


def test_kv_shares_lift_the_few_to_the_floor_and_the_rest_split_what_is_left() -> None:
    # 64 requests beside 2 and 1: the two small ones would get 3 MiB and 1.5 MiB, under the 8 MiB floor
    assert kv_shares(100 * MiB, [64, 2, 1], 8 * MiB) == [84 * MiB, 8 * MiB, 8 * MiB]
    # lifting one to the floor can push another under it: the floor holds for both
    assert kv_shares(100 * MiB, [64, 16, 8], 20 * MiB) == [60 * MiB, 20 * MiB, 20 * MiB]
    shares = kv_shares(100 * MiB, [5, 7, 11], 10 * MiB)
    assert shares is not None and min(shares) >= 10 * MiB and sum(shares) <= 100 * MiB
    assert shares == sorted(shares)  # more requests, never a smaller share
    # the floor for everyone does not fit: the models take turns instead
    assert kv_shares(29 * MiB, [1, 1, 1], 10 * MiB) is None
    assert kv_shares(30 * MiB, [1, 1, 1], 10 * MiB) == [10 * MiB] * 3


def _serving(name: str, prio: int, awake_since: float, requests: int = 1, **kw: object) -> Candidate:
    return _c(name, prio, 0.0, 40, requests=requests, suspendable=True, awake_since=awake_since, **kw)


def test_suspensions_take_the_lowest_priority_then_the_model_awake_longest() -> None:
    models = [_serving("hi-old", 5, 1.0), _serving("lo-new", 0, 8.0), _serving("lo-old", 0, 2.0)]
    room = {"used_bytes": 120 * MiB, "budget_bytes": 130 * MiB, "for_priority": 5, "awake_before": 9.0}
    assert [v.name for v in choose_suspensions(models, need_bytes=40 * MiB, **room) or []] == ["lo-old"]
    assert [v.name for v in choose_suspensions(models, need_bytes=80 * MiB, **room) or []] == [
        "lo-old",
        "lo-new",
    ]
    assert choose_suspensions(models, need_bytes=10 * MiB, **room) == []  # it fits: nobody goes
    assert choose_suspensions(models, need_bytes=500 * MiB, **room) is None


def test_among_equal_priorities_the_model_with_the_fewest_requests_is_suspended_first() -> None:
    """A suspension pauses every request of its model: the one serving 2 goes before one serving 41 that
    has been awake longer; equal counts fall back to the one awake longest."""
    models = [
        _serving("busy-old", 0, 1.0, requests=41),
        _serving("few-new", 0, 6.0, requests=2),
        _serving("few-old", 0, 3.0, requests=2),
    ]
    room = {"used_bytes": 120 * MiB, "budget_bytes": 130 * MiB, "for_priority": 0, "awake_before": 9.0}
    assert [v.name for v in choose_suspensions(models, need_bytes=80 * MiB, **room) or []] == [
        "few-old",
        "few-new",
    ]


def test_only_serving_suspendable_models_awake_long_enough_are_suspended() -> None:
    models = [
        _serving("young", 0, 5.0),  # awake after awake_before
        _serving("pinned", 0, 1.0, pinned=True),
        _serving("vip", 9, 1.0),  # a higher priority than the model waiting
        _c("idle", 0, 0.0, 40, suspendable=True, awake_since=1.0),  # idle: it sleeps, not suspends
        _c("cannot", 0, 0.0, 40, requests=1, awake_since=1.0),  # its engine cannot keep requests
        _serving("eligible", 0, 4.0),
    ]
    room = {"used_bytes": 240 * MiB, "budget_bytes": 250 * MiB, "for_priority": 0}
    chosen = choose_suspensions(models, need_bytes=40 * MiB, awake_before=4.5, **room)
    assert [v.name for v in chosen or []] == ["eligible"]
    assert choose_suspensions(models, need_bytes=40 * MiB, awake_before=3.0, **room) is None


def test_model_states_move_only_as_the_transition_table_allows() -> None:
    from elastic_kv_serve.config import ModelConfig
    from elastic_kv_serve.runtime import TRANSITIONS, InvalidTransition, ModelRuntime, State

    assert set(TRANSITIONS) == set(State)
    rt = ModelRuntime(ModelConfig(name="m", engine="vllm", model="/m"), idle_sleep_s=60.0, weights_bytes=1)
    for state in (State.STARTING, State.AWAKE, State.SLEEPING, State.ASLEEP, State.WAKING, State.AWAKE):
        rt.set_state(state)
        rt.set_state(state)  # staying is always allowed
    with pytest.raises(InvalidTransition, match="model m: awake -> waking"):
        rt.set_state(State.WAKING)
    assert rt.state is State.AWAKE  # refused: nothing changed
    rt.set_state(State.FAILED, "died")
    rt.set_state(State.STARTING)
    rt.set_state(State.STOPPED)
    for state in State:
        if state is not State.STOPPED:
            with pytest.raises(InvalidTransition):
                rt.set_state(state)
