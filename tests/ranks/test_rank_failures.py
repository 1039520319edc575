"""Ranks that die (SIGKILL, or os._exit at a chosen protocol step) or stall past the coordinator's timeout.

After each: either every living rank agrees with the others (and with what the coordinator reported) and holds
exactly the handles its pages need, or the coordinator is in the consistency-error state and tearing the pool
down on the living ranks gives every handle back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from elastic_kv.errors import StateConsistencyError
from elastic_kv.ranks.messages import Op
from ranks_harness import DIE_EXIT_CODE, Cluster


def _processes_only(cluster: Cluster) -> None:
    if cluster.kind == "inproc":
        pytest.skip("ranks in the caller's process cannot die or time out on their own")


def _assert_reclaimable(cluster: Cluster, pool: int) -> None:
    for r in range(cluster.world):
        if cluster.alive(r):
            live, empty = cluster.ctl(r, "drop_pool", pool)
            assert live == empty, f"rank {r} leaks {live - empty} handles"


def _assert_survivors_agree(cluster: Cluster, pool: int) -> None:
    """Living ranks agree with each other, are consistent and leak nothing (the coordinator may be in
    the error state)."""
    snaps = cluster.snapshots(pool)
    assert len({s[0] for s in snaps.values()}) == 1, f"living ranks diverge: {snaps}"
    assert all(s[2] and s[3] == 0 for s in snaps.values()), snaps
    cluster.assert_no_leaks(pool)


def _eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_rank_killed_while_idle(cluster: Cluster, pool: int) -> None:
    _processes_only(cluster)
    c = cluster.coordinator(pool)
    c.map([1, 2])
    cluster.kill(1)
    with pytest.raises(StateConsistencyError, match="rank 1 gone"):
        c.unmap([1])
    assert not c.consistent
    with pytest.raises(StateConsistencyError, match="consistency-error state"):
        c.map([3])
    _assert_reclaimable(cluster, pool)


STEPS = [
    # (op the dying rank dies on, before or after applying it, what the caller does)
    (Op.MAP, "die_before", "map"),
    (Op.MAP, "die_after", "map"),
    (Op.PREPARE, "die_before", "unmap"),
    (Op.PREPARE, "die_after", "unmap"),
    (Op.COMMIT, "die_before", "unmap"),
    (Op.COMMIT, "die_after", "unmap"),
    (Op.ROLLBACK, "die_before", "failed_map"),
    (Op.ABORT, "die_before", "failed_unmap"),
]


@pytest.mark.parametrize(("op", "when", "call"), STEPS, ids=[f"{s[1]}-{s[0].name}" for s in STEPS])
def test_rank_dies_at_a_protocol_step(cluster: Cluster, pool: int, op: Op, when: str, call: str) -> None:
    _processes_only(cluster)
    c = cluster.coordinator(pool)
    c.map([1, 2])
    dying = 2
    cluster.ctl(dying, "script", int(op), when)
    if call == "failed_map":  # another rank fails the MAP, so a ROLLBACK follows
        cluster.ctl(0, "fail", pool, "create", 1, 1, "oom")
    if call == "failed_unmap":  # another rank fails the PREPARE, so an ABORT follows
        cluster.ctl(0, "fail", pool, "unmap", 1, 1, "error")
    with pytest.raises(StateConsistencyError, match=f"rank {dying} gone"):
        if call in ("map", "failed_map"):
            c.map([3, 4])
        else:
            c.unmap([1])
    assert cluster.wait_dead(dying) == DIE_EXIT_CODE
    assert not c.consistent
    if cluster.kind == "socket":
        # Every living rank got the whole protocol (the socket transport reaches each rank on its own), so
        # the living ranks agree with each other: the map or unmap was undone, or (COMMIT) completed.
        _assert_survivors_agree(cluster, pool)
    _assert_reclaimable(cluster, pool)


def test_map_timing_out_on_one_rank_is_rolled_back(cluster: Cluster, pool: int) -> None:
    _processes_only(cluster)
    c = cluster.coordinator(pool, timeout=0.4, retries=4)
    c.map([1])
    cluster.ctl(1, "script", int(Op.MAP), "stall", 0.7)
    with pytest.raises(TimeoutError, match="rolled back on every rank"):
        c.map([2, 3])
    # The late MAP was applied by rank 1, then undone by the ROLLBACK queued behind it; stale replies dropped.
    assert c.consistent
    cluster.assert_agree(pool, [1])
    c.map([2])
    cluster.assert_agree(pool, [1, 2])


def test_ambiguous_commit_is_retried_never_aborted(cluster: Cluster, pool: int) -> None:
    _processes_only(cluster)
    c = cluster.coordinator(pool, timeout=0.3, retries=2)
    c.map([1, 2, 3])
    cluster.ctl(1, "script", int(Op.COMMIT), "stall", 1.0)
    c.unmap([2])  # every rank prepared: the unmap happened; rank 1's commit is still unconfirmed
    assert c.consistent and len(c.pending_commits) == 1
    assert cluster.snapshots(pool)[0][0] == (1, 3)
    _eventually(lambda: (c.sync(), c.pending_commits == ())[1])  # every later call retries it first
    c.map([4])
    cluster.assert_agree(pool, [1, 3, 4])


def test_unconfirmed_abort_enters_the_error_state(cluster: Cluster, pool: int) -> None:
    _processes_only(cluster)
    c = cluster.coordinator(pool, timeout=0.2, retries=2)
    c.map([1])
    cluster.ctl(1, "script", int(Op.PREPARE), "stall", 1.0)
    with pytest.raises(StateConsistencyError, match="abort"):
        c.unmap([1])
    assert not c.consistent
    # Rank 1 applies the late PREPARE, then the ABORTs queued behind it: the ranks end up agreeing, but the
    # coordinator could not know that in time, so it had to stop the pool.
    unmap_tx = 2  # tx 1 was the map; rank 1 prepares it late, then aborts it
    _eventually(lambda: cluster.ctl(1, "tx_state", pool, unmap_tx) == "aborted")
    cluster.assert_agree(pool, [1])
