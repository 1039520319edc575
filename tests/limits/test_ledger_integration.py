"""End to end: two processes, each a real ledger over the host data plane, one GPU-wide budget, kvctl.

Real pages are mapped (the host backend holds real memory for them), and what each process holds must
match what it charged: the budget bounds real memory, not only numbers.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic_kv.registry import Registry

from limits.helpers import JsonLineProcess

_vmm = pytest.importorskip("elastic_kv._vmm", reason="the data plane is not built (pip install packages/...)")

WORKER = Path(__file__).with_name("ledger_worker.py")
PAGE = 64 << 10


class LedgerProcess(JsonLineProcess):
    """A `ledger_worker.py` process: one ledger over the host data plane, with a pool record."""

    def __init__(self, env: dict[str, str], name: str, limit: int = 0) -> None:
        super().__init__([sys.executable, str(WORKER), "--name", name, "--limit", str(limit)], env)
        ready = self.read_reply()
        assert ready["page_bytes"] == PAGE


@pytest.fixture
def spawn_ledger(child_env: dict[str, str]) -> Iterator[Callable[..., LedgerProcess]]:
    started: list[LedgerProcess] = []

    def spawn(name: str, limit: int = 0) -> LedgerProcess:
        started.append(LedgerProcess(child_env, name, limit))
        return started[-1]

    yield spawn
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait()
        for stream in (worker.proc.stdin, worker.proc.stdout, worker.proc.stderr):
            if stream is not None:
                stream.close()


def consistent(state: dict[str, Any]) -> bool:
    """The ledger, its record and the data plane agree on what the process holds."""
    return state["charged"] == state["record_charged"] == state["backed"]


def test_two_ledgers_share_a_budget_and_pressure_is_not_a_crash(
    registry_dir: Path, spawn_ledger: Callable[..., LedgerProcess]
) -> None:
    registry = Registry(registry_dir)
    registry.set_budget("host:0", 12 * PAGE)
    a, b = spawn_ledger("ledger-a"), spawn_ledger("ledger-b")  # each backs its null block's page now
    got_a = a.send("fill")["got"]  # grows until the budget says no: alloc returns None, no exception
    got_b = b.send("fill")["got"]
    assert got_a == 3 + 10 * 4  # the 3 free blocks of its null block's page, then 10 pages of 4 blocks
    assert got_b == 3  # only what its null block's page already backs: no new page fits the budget
    state_a, state_b = a.send("state"), b.send("state")
    assert consistent(state_a) and consistent(state_b)
    assert state_a["charged"] + state_b["charged"] == 12 * PAGE == registry.device("host:0").charged_bytes
    # A frees 5 pages' worth; the emptied pages are unmapped (no reserve) and the budget goes to B.
    assert a.send("free 20")["ok"]
    assert b.send("fill")["got"] == 5 * 4
    state_a, state_b = a.send("state"), b.send("state")
    assert consistent(state_a) and consistent(state_b)
    assert state_a["charged"] == 6 * PAGE and state_b["charged"] == 6 * PAGE
    a.send("close")
    assert registry.device("host:0").charged_bytes == 6 * PAGE


def test_kvctl_limit_shrinks_a_live_ledger_as_blocks_drain(
    registry_dir: Path,
    spawn_ledger: Callable[..., LedgerProcess],
    kvctl: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    a = spawn_ledger("shrinking", limit=16 * PAGE)
    assert a.send("fill")["got"] == 16 * 4 - 1  # the null block takes one
    done = kvctl("limit", "shrinking", str(4 * PAGE))
    assert done.returncode == 0, done.stderr
    assert a.send("maintain")["ok"]  # the engine's next step sees the new limit
    assert a.send("state")["charged"] == 16 * PAGE  # live blocks are never unmapped
    assert a.send("fill")["got"] == 0  # but it issues nothing past the limit
    assert a.send("free 40")["ok"]  # 10 pages drain
    state = a.send("state")
    assert consistent(state) and state["charged"] == 6 * PAGE
    assert a.send("free 12")["ok"]  # 3 more: now under the limit
    assert a.send("state")["charged"] == 3 * PAGE
    assert a.send("fill")["got"] == 4  # and it may grow again, up to the new limit only
    state = a.send("state")
    assert consistent(state) and state["charged"] == 4 * PAGE
    assert Registry(registry_dir).pool("shrinking").charged_bytes == 4 * PAGE


def test_killed_ledger_gives_its_pages_to_the_other(
    registry_dir: Path, spawn_ledger: Callable[..., LedgerProcess]
) -> None:
    Registry(registry_dir).set_budget("host:0", 8 * PAGE)
    victim, survivor = spawn_ledger("victim"), spawn_ledger("survivor")
    assert victim.send("fill")["got"] > 0
    assert survivor.send("fill")["got"] == 3  # its null block's page only
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    # The ledger re-reads its headroom once per engine step (maintain), never on the alloc path; the
    # record's headroom discounts the dead owner's charge, so the next step may grow into it.
    assert survivor.send("maintain")["ok"]
    assert survivor.send("fill")["got"] == 7 * 4  # every page of the budget but its own null page
    assert Registry(registry_dir).device("host:0").charged_bytes == 8 * PAGE
