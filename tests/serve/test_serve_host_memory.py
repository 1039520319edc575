"""``elastic-kv serve`` with more models than fit, engines that sleep through their APIs, and a host budget.

vLLM and SGLang cannot sleep through their APIs on the CPU, so the engines here are
``tests/support/toy_engine.py`` processes (``engine = "command"``): real HTTP servers whose 10 MiB of
"weights" go into the server's host arena at level 1, are dropped at level 2 and read back from their
checkpoint on wake-up, and whose answers depend on every byte of them.

The module's server: four models of 10 MiB, a 30 MiB device budget (three awake), a 10 MiB host budget
(one level-1 copy), two engines starting at once. The tests run in file order on it: parallel start-up;
room made by putting the least recently used model to sleep at level 1; a second sleep while the arena is
full goes to level 2; an asleep engine killed is cleaned up and cold-started; an awake one killed is
restarted and the requests waiting for it are served; metrics; a shutdown that leaves nothing. Small
servers of their own cover the wait queue (429, then 503 at the wait's timeout, each with ``Retry-After``),
``preload``, the arena kept for the models used most recently (an older level-1 copy demoted to level 2),
KV pressure (a serving model's KV fills the budget: an idle model sleeps for it), and KV shares (a model
waking while every neighbour serves gets a share of their KV).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.serve import ServeProcess
from tests.support.toy_engine import answer, make_checkpoint

pytestmark = pytest.mark.slow

MiB = 1 << 20
TOY = str(Path(__file__).resolve().parents[1] / "support" / "toy_engine.py")


def _toy(name: str, folder: Path, seed: int, *, delay: float = 1.5, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "command",
        "model": str(make_checkpoint(folder / name, 10 * MiB, seed)),
        "command": [
            sys.executable,
            TOY,
            "--port",
            "{port}",
            "--model",
            "{model}",
            "--start-delay",
            str(delay),
        ],
        "sleep_path": "/sleep?level={level}",
        "wake_path": "/wake_up?level={level}",
        "idle_sleep_s": 0,
        **extra,
    }


def _expected(folder: Path, name: str, prompt: str, n: int = 6) -> str:
    return answer(prompt, (folder / name / "weights.bin").read_bytes(), n)


def _ask(srv: ServeProcess, model: str, prompt: str = "hello", n: int = 6) -> httpx.Response:
    return httpx.post(
        f"{srv.url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n}, timeout=120
    )


def _text(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    text: str = reply.json()["choices"][0]["text"]
    return text


def _transitions(status: dict[str, Any], name: str, kind: str) -> list[dict[str, Any]]:
    return [t for t in status[name]["transitions"] if t["kind"] == kind]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("toys")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, folder: Path) -> Iterator[ServeProcess]:
    models = [_toy(name, folder, seed) for seed, name in enumerate("abcd")]
    srv = ServeProcess(
        tmp_path_factory.mktemp("serve"),
        {"budget": "30M", "host_budget": "10M", "start_parallel": 2, "wake_timeout_s": 120,
         "restart_backoff_s": 0.2},
        models,
    )  # fmt: skip
    try:
        srv.wait_for({"a": "awake", "b": "awake", "c": "awake"}, timeout_s=120)
        yield srv
    finally:
        srv.stop()


SEEN: dict[str, Any] = {"pids": set()}


def _note_pids(srv: ServeProcess) -> dict[str, Any]:
    status = srv.status()
    SEEN["pids"].update(m["pid"] for m in status.values() if m["pid"])
    return status


def test_start_up_runs_two_engines_at_once_within_the_budget(server: ServeProcess) -> None:
    status = _note_pids(server)
    assert [status[n]["state"] for n in "abcd"] == ["awake", "awake", "awake", "asleep"]
    spans = sorted((t["at"] - t["seconds"], t["at"]) for n in "abc" for t in _transitions(status, n, "start"))
    assert len(spans) == 3 and spans[0][1] > spans[1][0], f"the first two starts did not overlap: {spans}"
    doc = server.document()
    assert doc["host_budget_bytes"] == 10 * MiB and doc["host_used_bytes"] == 0
    assert doc["host_arena"] is not None and Path(doc["host_arena"]).exists()
    SEEN["arena"] = Path(doc["host_arena"])


def test_each_model_answers_from_its_own_weights(server: ServeProcess, folder: Path) -> None:
    for name in "abc":  # also the order of last use: a is the least recently used now
        assert _text(_ask(server, name)) == _expected(folder, name, "hello")
        time.sleep(0.05)


def test_a_wake_puts_the_least_recently_used_model_to_sleep_at_level_1(
    server: ServeProcess, folder: Path
) -> None:
    assert _text(_ask(server, "d")) == _expected(folder, "d", "hello")  # d starts: a makes room
    status = _note_pids(server)
    assert [status[n]["state"] for n in "abcd"] == ["asleep", "awake", "awake", "awake"]
    (sleep,) = _transitions(status, "a", "sleep")
    assert sleep["level"] == "1" and status["a"]["sleep_level"] == 1
    assert status["a"]["host_bytes"] == 10 * MiB and status["a"]["pid"] is not None  # asleep, not stopped
    assert server.document()["host_used_bytes"] == 10 * MiB


def test_with_the_arena_full_the_next_sleep_is_level_2(server: ServeProcess, folder: Path) -> None:
    assert _text(_ask(server, "a", "again")) == _expected(folder, "a", "again")  # a wakes: b makes room
    status = server.status()
    (wake,) = _transitions(status, "a", "wake")
    assert wake["level"] == "1" and wake["room_seconds"] > 0
    (sleep,) = _transitions(status, "b", "sleep")
    assert sleep["level"] == "2", "the arena held a's weights when b went to sleep"
    assert status["b"]["host_bytes"] == 0 and status["a"]["host_bytes"] == 0
    assert _text(_ask(server, "b", "back")) == _expected(folder, "b", "back")  # c makes room (level 1)
    status = server.status()
    assert _transitions(status, "b", "wake")[-1]["level"] == "2"  # read back from its checkpoint
    assert _transitions(status, "c", "sleep")[-1]["level"] == "1" and status["c"]["host_bytes"] == 10 * MiB


def test_an_asleep_engine_that_dies_is_cleaned_up_and_cold_started(
    server: ServeProcess, folder: Path
) -> None:
    victim = _note_pids(server)["c"]["pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = server.document()
        c = next(m for m in doc["models"] if m["name"] == "c")
        if c["pid"] is None and doc["host_used_bytes"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the dead asleep engine was not cleaned up: {server.log_tail()}")
    assert c["state"] == "asleep"
    assert _text(_ask(server, "c", "cold")) == _expected(folder, "c", "cold")
    assert _transitions(server.status(), "c", "wake")[-1]["level"] == "cold"


def test_an_awake_engine_that_dies_is_restarted_and_its_waiting_requests_served(
    server: ServeProcess, folder: Path
) -> None:
    status = _note_pids(server)
    name = next(n for n in "abcd" if status[n]["state"] == "awake")
    os.kill(status[name]["pid"], signal.SIGKILL)
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda i: _ask(server, name, f"q{i}"), range(3)))
    assert [_text(r) for r in replies] == [_expected(folder, name, f"q{i}") for i in range(3)]
    status = _note_pids(server)
    assert status[name]["restarts"] == 1 and status[name]["state"] == "awake"


def test_metrics_show_host_memory_and_sleep_levels(server: ServeProcess) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "elastic_kv_serve_host_budget_bytes 1.048576e+07" in text
    assert 'elastic_kv_serve_sleep_seconds_count{level="2",model="b"} 1.0' in text
    assert 'elastic_kv_serve_wake_seconds_count{level="1",mode="engine",model="a"} 1.0' in text


def test_shutdown_removes_the_arena_and_every_engine(server: ServeProcess) -> None:
    _note_pids(server)
    assert server.stop() == -signal.SIGTERM
    assert not SEEN["arena"].exists()
    alive = [p for p in SEEN["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive


def test_a_full_queue_is_429_and_a_wait_past_its_timeout_503_both_with_retry_after(
    tmp_path: Path,
) -> None:
    (tmp_path / "q").mkdir()
    srv = ServeProcess(
        tmp_path / "q",
        {"max_queued": 2, "wake_timeout_s": 1.5},
        [_toy("slow", tmp_path, 7, delay=6.0)],
    )
    try:
        srv.wait_for({"slow": "starting"}, timeout_s=30)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: _ask(srv, "slow", f"p{i}"), range(4)))
        codes = sorted(r.status_code for r in replies)
        assert codes == [429, 429, 503, 503], [r.text for r in replies]
        for reply in replies:
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.json()["error"]["type"] in ("RateLimitError", "ServiceUnavailableError")
        srv.wait_for({"slow": "awake"}, timeout_s=60)
        assert _text(_ask(srv, "slow", "p0")) == _expected(tmp_path, "slow", "p0")
    finally:
        srv.stop()


def test_a_request_whose_engine_dies_under_it_is_sent_again_and_served_after_the_restart(
    tmp_path: Path,
) -> None:
    """The engine takes the request and dies before answering (the router's read fails, not its connect):
    the engine is gone, so the request is sent again and served by the restarted engine."""
    (tmp_path / "r").mkdir()
    srv = ServeProcess(tmp_path / "r", {"restart_backoff_s": 0.2}, [_toy("m", tmp_path, 3, delay=0.2)])
    try:
        srv.wait_for({"m": "awake"}, timeout_s=60)
        marker = tmp_path / "died"
        reply = httpx.post(
            f"{srv.url}/v1/completions",
            json={"model": "m", "prompt": "p", "max_tokens": 6, "die_once": str(marker)},
            timeout=120,
        )
        assert marker.exists()  # the first engine took it and died
        assert _text(reply) == _expected(tmp_path, "m", "p")
        assert srv.status()["m"]["restarts"] == 1
    finally:
        srv.stop()


def test_preload_starts_every_model_and_leaves_the_ones_that_do_not_fit_asleep(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    srv = ServeProcess(
        tmp_path / "p",
        {"budget": "10M", "host_budget": "10M", "preload": True},
        [_toy("hi", tmp_path, 1, delay=0.5), _toy("lo", tmp_path, 2, delay=0.5)],
    )
    try:
        status = srv.wait_for({"hi": "awake", "lo": "asleep"}, timeout_s=60)
        assert status["lo"]["sleep_level"] == 1 and _transitions(status, "lo", "start")
        assert _text(_ask(srv, "lo")) == _expected(tmp_path, "lo", "hello")  # hi makes room (equal priority)
        assert _transitions(srv.status(), "lo", "wake")[-1]["level"] == "1"  # a wake, not a cold start
    finally:
        srv.stop()


def test_the_arena_holds_the_copies_of_the_models_used_most_recently(tmp_path: Path) -> None:
    """Three models, two awake in a 20 MiB budget, one level-1 copy in a 10 MiB arena, engines that can
    demote a level-1 sleep (``demote_path``). ``x``, ``y``, ``z`` are asked in turn: ``x`` (least recently
    used) sleeps at level 1 for ``z``. Then ``y`` idles into sleep; it was used after ``x``, so ``x`` is
    demoted to level 2 (its extent given back) and ``y`` sleeps at level 1. ``x``'s next wake reads its
    weights from its checkpoint and answers from them. ``y`` idles for 6 s before it sleeps: long enough
    that, on a loaded machine, ``z`` is asked (and ``x`` put to sleep for it) before."""
    (tmp_path / "d").mkdir()
    extra = {"demote_path": "/demote"}
    srv = ServeProcess(
        tmp_path / "d",
        {"budget": "20M", "host_budget": "10M", "start_parallel": 2, "wake_timeout_s": 120},
        [_toy("x", tmp_path, 1, delay=0.2, **extra),
         _toy("y", tmp_path, 2, delay=0.2, idle_sleep_s=6, **extra),
         _toy("z", tmp_path, 3, delay=0.2, **extra)],
    )  # fmt: skip
    try:
        srv.wait_for({"x": "awake", "y": "awake", "z": "asleep"}, timeout_s=60)
        for name in "xyz":
            assert _text(_ask(srv, name)) == _expected(tmp_path, name, "hello")
        status = srv.status()
        assert (
            _transitions(status, "x", "sleep")[-1]["level"] == "1" and status["x"]["host_bytes"] == 10 * MiB
        )
        status = srv.wait_for({"x": "asleep", "y": "asleep", "z": "awake"}, timeout_s=30)
        assert _transitions(status, "y", "sleep")[-1]["level"] == "1"
        assert status["y"]["host_bytes"] == 10 * MiB and status["y"]["sleep_level"] == 1
        (demote,) = _transitions(status, "x", "demote")
        assert demote["level"] == "2" and status["x"]["sleep_level"] == 2 and status["x"]["host_bytes"] == 0
        assert "model x is demoted to level 2" in srv.log_tail(200)
        # a 10 MiB arena for two awake of three: one copy asleep, one for a swap; said once at start-up
        assert srv.log_tail(200).count("10.0 MiB more would keep every swap at level 1") == 1
        assert _text(_ask(srv, "x", "back")) == _expected(tmp_path, "x", "back")
        assert _transitions(srv.status(), "x", "wake")[-1]["level"] == "2"
    finally:
        srv.stop()


def test_an_engine_whose_core_died_behind_its_live_server_is_stopped_not_waited_for(tmp_path: Path) -> None:
    """vLLM's API server outlives a dead engine core while clients hold connections, and a sleep sent to it
    never answers. A wake that needs its room must not wait for that sleep: the server sees /health fail,
    stops the engine, wakes the other model, and starts the dead one again on its next request."""
    (tmp_path / "p").mkdir()
    srv = ServeProcess(
        tmp_path / "p",
        {"budget": "10M", "host_budget": "10M", "preload": True, "wake_timeout_s": 120},
        [_toy("hi", tmp_path, 1, delay=0.5), _toy("lo", tmp_path, 2, delay=0.5)],
    )
    try:
        status = srv.wait_for({"hi": "awake", "lo": "asleep"}, timeout_s=60)
        httpx.post(f"http://127.0.0.1:{status['hi']['port']}/fail_core", timeout=10).raise_for_status()
        t0 = time.monotonic()
        assert _text(_ask(srv, "lo")) == _expected(tmp_path, "lo", "hello")
        took = time.monotonic() - t0
        assert took < 30, f"the wake waited {took:.0f} s for a dead engine's sleep"
        assert "engine of hi died while it was asked to sleep" in srv.log_tail(200)
        assert _transitions(srv.status(), "hi", "sleep")[-1]["level"] == "stop"
        assert _text(_ask(srv, "hi")) == _expected(tmp_path, "hi", "hello")  # started again
    finally:
        srv.stop()


def test_a_serving_model_whose_kv_fills_the_budget_gets_an_idle_neighbours_memory(tmp_path: Path) -> None:
    """Two models awake in a 25 MiB budget (10 MiB weights each, never idle-sleeping): a request to ``a``
    holding 12 MiB of KV (charged to its real pool record) fills the 5 MiB left; ``b``, idle, is put to sleep
    for it and the request completes."""
    (tmp_path / "k").mkdir()
    srv = ServeProcess(
        tmp_path / "k",
        {"budget": "25M", "host_budget": "10M", "start_parallel": 2, "kv_headroom": "4M",
         "pressure_idle_s": 0.5},
        [_toy("a", tmp_path, 1, delay=0.2), _toy("b", tmp_path, 2, delay=0.2)],
    )  # fmt: skip
    try:
        srv.wait_for({"a": "awake", "b": "awake"}, timeout_s=60)
        time.sleep(1.0)  # b idles past pressure_idle_s
        body = {"model": "a", "prompt": "grow", "max_tokens": 4, "kv_bytes": 12 * MiB}
        reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert _text(reply) == _expected(tmp_path, "a", "grow", 4)
        status = srv.status()
        assert status["b"]["state"] == "asleep" and _transitions(status, "b", "sleep")
        assert status["a"]["state"] == "awake" and not _transitions(status, "a", "sleep")
    finally:
        srv.stop()


def _wait_kv(srv: ServeProcess, models: str, at_least: int) -> None:
    """Wait (30 s at most) until ``models`` hold ``at_least`` bytes of KV between them."""
    deadline = time.monotonic() + 30
    while sum(srv.status()[m]["kv_bytes"] for m in models) < at_least:
        assert time.monotonic() < deadline, srv.status()
        time.sleep(0.1)


def _fill_the_budget(
    srv: ServeProcess, pool: ThreadPoolExecutor, ask: Callable[[str, int, int], httpx.Response]
) -> dict[str, Future[httpx.Response]]:
    """``a`` and ``b`` each asked for 40 tokens holding 12 MiB of KV; returns once their KV fills the 20 MiB
    the budget leaves beside the weights."""
    long = {m: pool.submit(ask, m, 40, 12 * MiB) for m in "ab"}
    _wait_kv(srv, "ab", 20 * MiB)
    return long


def _ask_kv(srv: ServeProcess, model: str, n: int, kv: int) -> httpx.Response:
    """``model`` asked for ``n`` tokens of its own name, holding ``kv`` bytes of KV while it runs."""
    body = {"model": model, "prompt": model, "max_tokens": n, "kv_bytes": kv}
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=180)


def _share_server(
    tmp_path: Path,
    *,
    keep_requests: bool = False,
    b_idle_sleep_s: float = 0,
    c_idle_sleep_s: float = 1,
    **server: Any,
) -> ServeProcess:
    """A 50 MiB budget, three models of 15 MiB (declared) decoding 500 ms a token, ``b`` idle-sleeping after
    ``b_idle_sleep_s`` and ``c`` after ``c_idle_sleep_s`` (0: never); engines that keep their requests asleep
    where ``keep_requests``; ``server``: settings on top of the budget's."""
    (tmp_path / "s").mkdir()

    def toy(name: str, seed: int, idle_sleep_s: float) -> dict[str, Any]:
        model = _toy(name, tmp_path, seed, delay=0.2, weights_bytes="15M", idle_sleep_s=idle_sleep_s)
        model["command"] += ["--token-ms", "500"]
        if keep_requests:
            model["sleep_path"] = "/sleep?level={level}&mode={mode}"
        return model

    settings = {"budget": "50M", "host_budget": "20M", "kv_headroom": "1M", "pressure_idle_s": 30, **server}
    return ServeProcess(
        tmp_path / "s", settings, [toy("a", 1, 0), toy("b", 2, b_idle_sleep_s), toy("c", 3, c_idle_sleep_s)]
    )


def test_a_model_waking_while_every_neighbour_serves_gets_a_share_of_their_kv(tmp_path: Path) -> None:
    """A 50 MiB budget, three models of 15 MiB (declared), ``c`` idle-sleeping: ``a`` and ``b`` serve 20 s
    requests that want 12 MiB of KV each and fill the 20 MiB left. A request to ``c`` finds no idle model to
    put to sleep; instead of waiting for ``a`` or ``b`` to finish, their KV is shared three ways (5 MiB of
    room, 1.66 MiB each), their engines give KV back down to the share, ``c`` wakes and answers while they
    still run; theirs complete too, and the shares are lifted once at most one model serves."""
    srv = _share_server(tmp_path)
    try:
        srv.wait_for({"a": "awake", "b": "awake", "c": "asleep"}, timeout_s=60)
        done: dict[str, float] = {}

        def ask(model: str, n: int, kv: int) -> httpx.Response:
            body = {"model": model, "prompt": model, "max_tokens": n, "kv_bytes": kv}
            reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
            done[model] = time.monotonic()
            return reply

        with ThreadPoolExecutor(3) as pool:
            long = _fill_the_budget(srv, pool, ask)
            t0 = time.monotonic()
            short = pool.submit(ask, "c", 2, 0)
            assert _text(short.result(timeout=60)) == _expected(tmp_path, "c", "c", 2)
            assert done["c"] - t0 < 8.0  # a and b run about 20 s
            status = srv.status()
            assert not any(long[m].done() for m in "ab"), status
            assert status["a"]["kv_limit_bytes"] == status["b"]["kv_limit_bytes"] == (5 * MiB) // 3
            wake = _transitions(status, "c", "wake")[-1]
            assert wake["level"] == "1" and wake["seconds"] < 8.0, wake
            for m in "ab":
                assert _text(long[m].result(timeout=60)) == _expected(tmp_path, m, m, 40)
                stats = httpx.get(f"http://127.0.0.1:{status[m]['port']}/stats", timeout=10).json()
                assert stats["preemptions"] >= 1, (m, stats)
        deadline = time.monotonic() + 10
        while any(srv.status()[m]["kv_limit_bytes"] is not None for m in "abc"):
            assert time.monotonic() < deadline, srv.status()
            time.sleep(0.1)
        from elastic_kv.registry import Registry

        pools = Registry(srv.registry).pools()
        assert len(pools) == 3 and all(p.limit_bytes == 0 for p in pools), pools
    finally:
        srv.stop()


def test_kv_shares_follow_how_many_requests_each_model_serves(tmp_path: Path) -> None:
    """The set-up above, but ``a`` serves four requests (3 MiB of KV each) and ``b`` one (8 MiB): when a
    request to ``c`` makes the three share the 5 MiB of room, ``a`` gets four parts of six and ``b`` and
    ``c`` one each, not a third each; every answer is exact."""
    srv = _share_server(tmp_path, kv_share_min="512K")
    try:
        srv.wait_for({"a": "awake", "b": "awake", "c": "asleep"}, timeout_s=60)

        def ask(model: str, prompt: str, kv: int, n: int = 40) -> httpx.Response:
            body = {"model": model, "prompt": prompt, "max_tokens": n, "kv_bytes": kv}
            return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(6) as pool:
            long = {p: pool.submit(ask, "a", p, 3 * MiB) for p in ("a1", "a2", "a3", "a4")}
            long["b1"] = pool.submit(ask, "b", "b1", 8 * MiB)
            _wait_kv(srv, "ab", 20 * MiB)
            reply = pool.submit(ask, "c", "c1", 0, 2).result(timeout=60)
            assert _text(reply) == _expected(tmp_path, "c", "c1", 2)
            status = srv.status()
            assert not any(long[p].done() for p in ("a1", "b1")), status
            limits = [status[m]["kv_limit_bytes"] for m in "ab"]
            assert limits == [5 * MiB * 4 // 6, 5 * MiB // 6], status
            for prompt, future in long.items():
                assert _text(future.result(timeout=120)) == _expected(tmp_path, prompt[0], prompt, 40)
    finally:
        srv.stop()


def _floor_server(tmp_path: Path, *, max_suspend_s: float, b_idle_sleep_s: float) -> ServeProcess:
    """The KV-share set-up above, engines that keep their requests asleep, ``kv_share_min_weights = 0.5`` (a
    three-way share is below the floor) and models that may be suspended once awake 1 s; ``b`` idle-sleeps
    after ``b_idle_sleep_s`` (0: never)."""
    return _share_server(
        tmp_path, keep_requests=True, b_idle_sleep_s=b_idle_sleep_s, host_budget="40M",
        kv_share_min_weights=0.5, min_awake_s=1, max_suspend_s=max_suspend_s,
    )  # fmt: skip


def test_below_a_share_floor_of_half_their_weights_models_take_turns_instead(tmp_path: Path) -> None:
    """The set-up above, engines that keep their requests asleep, and ``kv_share_min_weights = 0.5``: a
    three-way share (1.66 MiB each) is below half a model's 15 MiB of weights, so ``c`` wakes by suspending
    the serving model awake longest instead of shrinking both; no share falls below the floor, every answer
    is exact."""
    srv = _floor_server(tmp_path, max_suspend_s=3, b_idle_sleep_s=0)
    try:
        srv.wait_for({"a": "awake", "b": "awake", "c": "asleep"}, timeout_s=60)

        ask = functools.partial(_ask_kv, srv)

        with ThreadPoolExecutor(3) as pool:
            long = _fill_the_budget(srv, pool, ask)
            t0 = time.monotonic()
            assert _text(pool.submit(ask, "c", 2, 0).result(timeout=60)) == _expected(tmp_path, "c", "c", 2)
            assert time.monotonic() - t0 < 8.0  # a and b run about 20 s
            status = srv.status()
            suspended = [m for m in "ab" if _transitions(status, m, "suspend")]
            assert len(suspended) == 1 and not any(long[m].done() for m in "ab"), status
            # shares come only at or above the floor (b and c serving side by side: 10 MiB each)
            limits = [status[m]["kv_limit_bytes"] for m in "abc"]
            assert all(limit is None or limit >= 15 * MiB // 2 for limit in limits), limits
            for m in "ab":
                assert _text(long[m].result(timeout=90)) == _expected(tmp_path, m, m, 40)
    finally:
        srv.stop()


def test_a_model_woken_to_serve_makes_room_for_its_kv_floor_not_only_its_weights(tmp_path: Path) -> None:
    """A 50 MiB budget, four models of 10 MiB (declared) decoding 500 ms a token, engines that keep their
    requests asleep, ``kv_share_min_weights = 1`` (a serving model's KV share is at least 10 MiB: two serve
    at once). ``a``, ``b`` and ``c`` are awake when their 20 s requests come (8 MiB of KV each; they fill
    the 20 MiB left). A request to ``d`` (8 MiB) suspends two of them, not one: after one, ``d``'s weights
    would fit but its KV would not, the two left holding it while their requests ran. ``d`` answers within
    seconds; the suspended models resume and every answer is exact."""
    (tmp_path / "f").mkdir()

    def toy(name: str, seed: int, idle_sleep_s: float) -> dict[str, Any]:
        model = _toy(name, tmp_path, seed, delay=0.2, weights_bytes="10M", idle_sleep_s=idle_sleep_s)
        model["command"] += ["--token-ms", "500"]
        model["sleep_path"] = "/sleep?level={level}&mode={mode}"
        return model

    settings = {
        "budget": "50M", "host_budget": "40M", "kv_headroom": "1M", "pressure_idle_s": 30,
        "kv_share_min_weights": 1, "min_awake_s": 1, "max_suspend_s": 60,
    }  # fmt: skip
    srv = ServeProcess(
        tmp_path / "f", settings, [toy("a", 1, 0), toy("b", 2, 0), toy("c", 3, 0), toy("d", 4, 1)]
    )
    try:
        srv.wait_for({"a": "awake", "b": "awake", "c": "awake", "d": "asleep"}, timeout_s=60)

        ask = functools.partial(_ask_kv, srv, kv=8 * MiB)

        with ThreadPoolExecutor(4) as pool:
            long = {m: pool.submit(ask, m, 40) for m in "abc"}
            _wait_kv(srv, "abc", 20 * MiB)
            t0 = time.monotonic()
            assert _text(pool.submit(ask, "d", 2).result(timeout=60)) == _expected(tmp_path, "d", "d", 2)
            assert time.monotonic() - t0 < 8.0  # the others' requests run 20 s once they hold their KV
            status = srv.status()
            assert len([m for m in "abc" if _transitions(status, m, "suspend")]) == 2, status
            for m in "abc":
                assert _text(long[m].result(timeout=120)) == _expected(tmp_path, m, m, 40)
    finally:
        srv.stop()


def test_a_serving_model_that_gets_no_kv_below_the_floors_takes_a_turn(tmp_path: Path) -> None:
    """The KV-share set-up with all three models awake, engines that keep their requests asleep and
    ``kv_share_min_weights = 0.5``: the floor for three serving (7.5 MiB each) does not fit, so no shares
    are set. ``a`` and ``b`` fill the 5 MiB of KV left with 20 s requests; a request to ``c`` (2 MiB) finds
    none. ``c`` holds no KV for a second (``min_awake_s``), then one of the others is suspended for it, as
    for a wake, rather than ``c`` waiting for their requests to end; it resumes later, every answer exact."""
    srv = _share_server(
        tmp_path, keep_requests=True, c_idle_sleep_s=0, host_budget="40M", kv_share_min_weights=0.5,
        min_awake_s=1, max_suspend_s=60,
    )  # fmt: skip
    try:
        srv.wait_for({"a": "awake", "b": "awake", "c": "awake"}, timeout_s=60)

        ask = functools.partial(_ask_kv, srv)

        with ThreadPoolExecutor(3) as pool:
            long = {"a": pool.submit(ask, "a", 40, 3 * MiB), "b": pool.submit(ask, "b", 40, 2 * MiB)}
            _wait_kv(srv, "ab", 5 * MiB)
            t0 = time.monotonic()
            assert _text(pool.submit(ask, "c", 2, 2 * MiB).result(timeout=60)) == _expected(
                tmp_path, "c", "c", 2
            )
            assert time.monotonic() - t0 < 8.0  # a and b run 20 s
            status = srv.status()
            assert len([m for m in "ab" if _transitions(status, m, "suspend")]) == 1, status
            assert not _transitions(status, "c", "suspend"), status
            for m in "ab":
                assert _text(long[m].result(timeout=120)) == _expected(tmp_path, m, m, 40)
    finally:
        srv.stop()


def test_the_serving_model_with_the_fewest_requests_is_suspended_first(tmp_path: Path) -> None:
    """The floor set-up above, ``b`` woken by its request after ``a`` (so ``a`` is the model awake longest):
    ``a`` serves two requests, ``b`` one; ``c``'s request suspends ``b``, whose suspension pauses the fewest
    requests, and every answer is exact."""
    srv = _floor_server(tmp_path, max_suspend_s=30, b_idle_sleep_s=1)
    try:
        srv.wait_for({"a": "awake", "b": "asleep", "c": "asleep"}, timeout_s=60)

        def ask(model: str, prompt: str, kv: int) -> httpx.Response:
            body = {"model": model, "prompt": prompt, "max_tokens": 40, "kv_bytes": kv}
            return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(4) as pool:
            long = {p: pool.submit(ask, "a", p, 6 * MiB) for p in ("a1", "a2")}
            srv.wait_for({"a": "awake"}, timeout_s=30)
            long["b1"] = pool.submit(ask, "b", "b1", 12 * MiB)
            _wait_kv(srv, "ab", 20 * MiB)
            time.sleep(1.5)  # b has been awake min_awake_s: both may be suspended
            reply = pool.submit(ask, "c", "c1", 0).result(timeout=60)
            assert _text(reply) == _expected(tmp_path, "c", "c1", 40)
            status = srv.status()
            assert [m for m in "ab" if _transitions(status, m, "suspend")] == ["b"], status
            for prompt, future in long.items():
                assert _text(future.result(timeout=120)) == _expected(tmp_path, prompt[0], prompt, 40)
    finally:
        srv.stop()


def _turns_server(
    tmp_path: Path,
    *,
    refuse_keep: bool = False,
    names: str = "abc",
    host_budget: str = "40M",
    priority: dict[str, int] | None = None,
    idle_sleep_s: float = 0,
) -> ServeProcess:
    """Models ``names`` (three by default) of 15 MiB (declared) in a 35 MiB budget (two awake), each decoding
    250 ms a token; a model may be suspended once awake 1 s and takes its turn back after 3 s suspended. All
    are preloaded: with equal priorities ``a`` and ``b`` end up awake, the others asleep at level 1 (their
    wake is a copy, not a start). ``priority``: the models' priorities where not 0; ``idle_sleep_s``: theirs
    (0: never)."""

    def toy(name: str, seed: int) -> dict[str, Any]:
        model = _toy(
            name, tmp_path, seed, delay=0.2, weights_bytes="15M", priority=(priority or {}).get(name, 0),
            idle_sleep_s=idle_sleep_s,
        )  # fmt: skip
        model["command"] += ["--token-ms", "250", *(["--refuse-keep"] if refuse_keep else [])]
        model["sleep_path"] = "/sleep?level={level}&mode={mode}"
        return model

    (tmp_path / "serve").mkdir()
    return ServeProcess(
        tmp_path / "serve",
        {"budget": "35M", "host_budget": host_budget, "min_awake_s": 1, "max_suspend_s": 3,
         "wake_timeout_s": 120, "preload": True},
        [toy(name, seed) for seed, name in enumerate(names, start=1)],
    )  # fmt: skip


def _ask_timed(srv: ServeProcess, model: str, n: int, done: dict[str, float]) -> httpx.Response:
    body = {"model": model, "prompt": model, "max_tokens": n, "kv_bytes": 2 * MiB}
    reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=180)
    done[model] = time.monotonic()
    return reply


@dataclass
class _Turns:
    """Two models serving and a third asked for (:func:`_two_serving_then_c`)."""

    srv: ServeProcess
    oldest: str  # of a and b, the one awake longest: a suspension's first choice
    first: dict[str, Future[httpx.Response]]  # a's and b's requests
    third: Future[httpx.Response]  # c's request
    asked_at: float  # when c was asked for (monotonic)
    done: dict[str, float]  # when each request ended (monotonic)


@contextlib.contextmanager
def _two_serving_then_c(tmp_path: Path, n_ab: int, n_c: int, **server: Any) -> Iterator[_Turns]:
    """The :func:`_turns_server`, ``a`` and ``b`` serving ``n_ab``-token requests that hold 2 MiB of KV each,
    both awake past ``min_awake_s``; then a request of ``n_c`` tokens to ``c``."""
    srv = _turns_server(tmp_path, **server)
    pool = ThreadPoolExecutor(3)
    try:
        srv.wait_for({"a": "awake", "b": "awake", "c": "asleep"}, timeout_s=60)
        done: dict[str, float] = {}
        first = {m: pool.submit(_ask_timed, srv, m, n_ab, done) for m in "ab"}
        deadline = time.monotonic() + 30
        while not all(m["in_flight"] and m["kv_bytes"] >= 2 * MiB for m in map(srv.status().get, "ab")):
            assert time.monotonic() < deadline, srv.status()
            time.sleep(0.1)
        time.sleep(1.0)  # both awake past min_awake_s
        status = srv.status()
        oldest = min("ab", key=lambda n: _transitions(status, n, "start")[-1]["at"])
        asked_at = time.monotonic()
        yield _Turns(srv, oldest, first, pool.submit(_ask_timed, srv, "c", n_c, done), asked_at, done)
    finally:
        srv.stop()  # first: requests still open end with the server
        pool.shutdown()


def test_more_models_serving_than_fit_take_turns_and_every_request_completes(tmp_path: Path) -> None:
    """``a`` and ``b`` serve 10 s requests and fill the budget; a request to ``c`` suspends the one awake
    longest instead of waiting for either to finish. That one keeps its request in its engine, gives its KV
    back and, 3 s later, takes its turn back from the other (awake since before the suspension). Every
    answer is the one each model's weights give, and no model is left suspended."""
    with _two_serving_then_c(tmp_path, 40, 40) as turns:
        srv, victim = turns.srv, turns.oldest
        other = "b" if victim == "a" else "a"
        srv.wait_for({"c": "awake"}, timeout_s=30)
        woke_s = time.monotonic() - turns.asked_at
        status = srv.status()
        assert status[victim]["state"] == "asleep" and status[victim]["suspended"], status[victim]
        assert not any(f.done() for f in turns.first.values()), "a request ended before c woke"
        assert woke_s < 8.0, f"c waited {woke_s:.1f} s: for a request to end, not for a suspension"
        (suspend,) = _transitions(status, victim, "suspend")
        assert suspend["level"] == "1" and status[victim]["in_flight"] == 1
        assert status[victim]["kv_bytes"] < 2 * MiB, "the suspended engine kept its requests' KV"
        replies = {m: f.result(timeout=120) for m, f in [*turns.first.items(), ("c", turns.third)]}
        for m, reply in replies.items():
            assert _text(reply) == _expected(tmp_path, m, m, 40)
        status = srv.status()
        assert [t["kind"] for t in status[victim]["transitions"]][-2:] == ["suspend", "resume"]
        assert _transitions(status, other, "suspend"), f"{victim} did not take its turn back from {other}"
        assert not any(m["suspended"] for m in status.values())
        stats = httpx.get(f"http://127.0.0.1:{status[victim]['port']}/stats", timeout=10).json()
        assert stats["suspended"] >= 1 and stats["preemptions"] >= 1, stats
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        line = f'elastic_kv_serve_model_suspends_total{{model="{victim}"}} {status[victim]["suspends"]:.1f}'
        assert line in metrics and f'elastic_kv_serve_model_suspended{{model="{victim}"}} 0.0' in metrics


def _resumed_while_running(
    srv: ServeProcess, names: str, running: dict[str, Future[httpx.Response]]
) -> dict[str, Any]:
    """Wait (30 s at most) until each of ``names`` has resumed, asserting that none of the ``running``
    requests ended first (the models took their turns back, not a neighbour's ended request); the status."""
    deadline = time.monotonic() + 30
    while True:
        status = srv.status()
        assert not any(f.done() for f in running.values()), f"{names} waited for a request to end: {status}"
        if all(_transitions(status, m, "resume") for m in names):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def test_models_suspended_together_take_their_turns_back_from_the_ones_that_replaced_them(
    tmp_path: Path,
) -> None:
    """Four models, two awake: ``a`` and ``b`` serve, then ``c`` and ``d`` are asked for at once and suspend
    both. No model awake now was awake before those suspensions, yet ``a`` and ``b`` take their turns back
    once they have waited ``max_suspend_s`` (3 s) from models awake as long, while ``c``'s and ``d``'s 10 s
    requests still run, instead of waiting for one of them to end. Every answer is exact."""
    srv = _turns_server(tmp_path, names="abcd", host_budget="70M")
    try:
        srv.wait_for({"a": "awake", "b": "awake", "c": "asleep", "d": "asleep"}, timeout_s=60)
        with ThreadPoolExecutor(4) as pool:
            done: dict[str, float] = {}
            first = {m: pool.submit(_ask_timed, srv, m, 40, done) for m in "ab"}
            srv.wait_for({"a": "awake", "b": "awake"}, timeout_s=30)
            time.sleep(1.5)  # both awake past min_awake_s
            second = {m: pool.submit(_ask_timed, srv, m, 40, done) for m in "cd"}
            srv.wait_for({"c": "awake", "d": "awake"}, timeout_s=30)
            assert all(srv.status()[m]["suspended"] for m in "ab")
            _resumed_while_running(srv, "ab", second)
            for m, future in [*first.items(), *second.items()]:
                assert _text(future.result(timeout=120)) == _expected(tmp_path, m, m, 40)
            assert not any(m["suspended"] for m in srv.status().values())
    finally:
        srv.stop()


def test_a_suspended_model_that_finds_no_room_does_not_hold_back_the_next_one(tmp_path: Path) -> None:
    """Four models, two awake, ``a`` of priority 0 and the others of priority 1, all asleep once idle 1 s:
    ``a`` and ``b`` serve, then ``c`` and ``d`` suspend ``a`` (the lowest priority goes first) and ``b``.
    ``a``, suspended first, may not suspend ``c`` or ``d`` (higher priority) and waits for a request to end;
    ``b`` behind it takes its turn back meanwhile."""
    priority = {"b": 1, "c": 1, "d": 1}
    srv = _turns_server(tmp_path, names="abcd", host_budget="70M", priority=priority, idle_sleep_s=1)
    try:
        srv.wait_ready(timeout_s=60)
        srv.wait_for(dict.fromkeys("abcd", "asleep"), timeout_s=30)
        with ThreadPoolExecutor(4) as pool:
            done: dict[str, float] = {}
            first = {m: pool.submit(_ask_timed, srv, m, 40, done) for m in "ab"}
            srv.wait_for({"a": "awake", "b": "awake"}, timeout_s=30)
            time.sleep(1.5)  # both awake past min_awake_s
            second = {"c": pool.submit(_ask_timed, srv, "c", 40, done)}
            srv.wait_for({"c": "awake"}, timeout_s=30)
            second["d"] = pool.submit(_ask_timed, srv, "d", 40, done)
            srv.wait_for({"d": "awake"}, timeout_s=30)
            status = srv.status()
            assert status["a"]["suspended"] and status["b"]["suspended"], status
            assert (
                _transitions(status, "a", "suspend")[0]["at"] < _transitions(status, "b", "suspend")[0]["at"]
            )
            status = _resumed_while_running(srv, "b", second)
            assert status["a"]["suspended"] and not _transitions(status, "a", "resume"), status["a"]
            for m, future in [*first.items(), *second.items()]:
                assert _text(future.result(timeout=120)) == _expected(tmp_path, m, m, 40)
    finally:
        srv.stop()


def test_an_engine_that_refuses_a_suspension_keeps_serving(tmp_path: Path) -> None:
    """The same three models, but their engines answer a keep-mode sleep with 409: ``a`` is woken again if
    needed and keeps serving, is not asked again, and ``c`` waits for a request to end; nothing is lost."""
    with _two_serving_then_c(tmp_path, 16, 4, refuse_keep=True) as turns:
        srv = turns.srv
        pids = {n: m["pid"] for n, m in srv.status().items()}
        replies = {m: f.result(timeout=120) for m, f in [*turns.first.items(), ("c", turns.third)]}
        for m, reply in replies.items():
            assert _text(reply) == _expected(tmp_path, m, m, 16 if m in "ab" else 4)
        done = turns.done
        assert done["c"] > min(done["a"], done["b"]), "c was served before a neighbour's request ended"
        status = srv.status()
        assert not any(_transitions(status, n, "suspend") for n in "abc")
        assert status["a"]["pid"] == pids["a"] and status["b"]["pid"] == pids["b"]  # not restarted
        assert "was not suspended" in srv.log_tail(200)


def test_a_suspended_engine_that_dies_is_started_again_and_its_kept_request_served(tmp_path: Path) -> None:
    """The model awake longest is suspended for ``c`` and then killed: the request it kept is sent again (its
    engine died before answering) and served by the engine cold-started for it; its suspension and arena
    extent do not outlive the dead engine, and the others are unaffected."""
    with _two_serving_then_c(tmp_path, 40, 8) as turns:
        srv, victim = turns.srv, turns.oldest
        other = "b" if victim == "a" else "a"
        srv.wait_for({"c": "awake"}, timeout_s=30)
        status = srv.status()
        assert status[victim]["suspended"] and status[victim]["host_bytes"] == 10 * MiB, status[victim]
        killed = status[victim]["pid"]
        os.kill(killed, signal.SIGKILL)
        assert _text(turns.first[victim].result(timeout=120)) == _expected(tmp_path, victim, victim, 40)
        assert _text(turns.first[other].result(timeout=120)) == _expected(tmp_path, other, other, 40)
        assert _text(turns.third.result(timeout=120)) == _expected(tmp_path, "c", "c", 8)
        status = srv.status()
        assert status[victim]["pid"] not in (None, killed), status[victim]
        assert _transitions(status, victim, "wake")[-1]["level"] == "cold"
        assert _text(_ask(srv, victim, "again")) == _expected(tmp_path, victim, "again")
        now = srv.status()[victim]  # awake: the dead engine's arena extent was given back
        assert now["state"] == "awake" and not now["suspended"] and now["host_bytes"] == 0, now


@pytest.mark.parametrize(("host_budget", "level"), [("60M", "1"), ("30M", "2")])
def test_a_suspended_model_that_parks_its_kv_gives_that_memory_to_the_model_it_made_room_for(
    tmp_path: Path, host_budget: str, level: str
) -> None:
    """Engines that park a suspension's KV in host memory (the vLLM plugin's way; the toy's
    ``--park-keep``): its pool stays charged for it, but the device holds none of it. ``a`` serves with
    16 MiB of KV; ``b`` is asked for a request needing 16 MiB as well, which does not fit beside ``a``
    (40 MiB: two 15 MiB models and 10 MiB of KV, below a share floor of the weights). ``b`` suspends ``a``,
    and the server raises the device's
    KV budget by what ``a`` parked, so ``b``'s KV grows into it at once instead of waiting for ``a``'s turn
    to come back; once ``b`` is idle, ``a`` wakes with room for its parked KV and goes on without giving any
    of it back (no preemption), both answers being their weights'. The engine parks the KV in the host
    arena before it copies its weights there: with a 30 MiB arena (10 MiB of it ``b``'s level-1 copy) the
    KV fits but the weights (15 MiB) do not fit beside it, so the suspension is level 2 (the weights read
    again at the wake) -- a level 1 would have copied them outside the host budget (vLLM's own host
    copies; the toy refuses it)."""

    def toy(name: str, seed: int, idle_sleep_s: float) -> dict[str, Any]:
        model = _toy(name, tmp_path, seed, delay=0.2, weights_bytes="15M", idle_sleep_s=idle_sleep_s)
        model["command"] += ["--token-ms", "250", "--park-keep"]
        model["sleep_path"] = "/sleep?level={level}&mode={mode}"
        return model

    (tmp_path / "serve").mkdir()
    srv = ServeProcess(
        tmp_path / "serve",
        {"budget": "40M", "host_budget": host_budget, "min_awake_s": 1, "max_suspend_s": 60,
         "wake_timeout_s": 120, "kv_headroom": "1M", "kv_share_min_weights": 1},
        [toy("a", 1, 0), toy("b", 2, 1)],
    )  # fmt: skip
    pool = ThreadPoolExecutor(2)
    try:
        srv.wait_for({"a": "awake", "b": "asleep"}, timeout_s=60)
        first = pool.submit(_ask_kv, srv, "a", 40, 16 * MiB)
        _wait_kv(srv, "a", 16 * MiB)
        time.sleep(1.2)  # a awake past min_awake_s
        asked = time.monotonic()
        second = pool.submit(_ask_kv, srv, "b", 12, 16 * MiB)
        srv.wait_for({"b": "awake"}, timeout_s=30)
        status = srv.status()
        assert status["a"]["suspended"] and status["a"]["parked_kv_bytes"] == 16 * MiB, status["a"]
        assert _text(second.result(timeout=60)) == _expected(tmp_path, "b", "b", 12)
        took = time.monotonic() - asked
        assert took < 10.0, f"b took {took:.1f} s: it waited for a's turn, not for the KV a parked"
        assert _text(first.result(timeout=120)) == _expected(tmp_path, "a", "a", 40)
        status = srv.status()
        suspend, resume = status["a"]["transitions"][-2:]
        assert (suspend["kind"], resume["kind"]) == ("suspend", "resume")
        assert (suspend["level"], suspend["kept"], suspend["parked_bytes"]) == (level, 1, 16 * MiB), suspend
        assert status["a"]["parked_kv_bytes"] == 0
        stats = httpx.get(f"http://127.0.0.1:{status['a']['port']}/stats", timeout=10).json()
        assert stats["suspended"] == 1 and stats["preemptions"] == 0, stats
    finally:
        srv.stop()
        pool.shutdown()
