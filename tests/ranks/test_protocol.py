"""The ranks protocol end to end, over every transport: real data-plane groups (host backend) in every rank,
data-plane failures injected with FaultInjectingBackend, handle counts checked on every rank."""

from __future__ import annotations

import pytest
from elastic_kv import _vmm
from elastic_kv.errors import PoolExhausted, StateConsistencyError
from elastic_kv.ranks import Coordinator
from ranks_harness import Cluster


def test_map_and_unmap_reach_every_rank(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([1, 2, 3])
    cluster.assert_agree(pool, [1, 2, 3])
    c.unmap([2])
    cluster.assert_agree(pool, [1, 3])
    assert [s.mapped_pages for s in c.status()] == [(1, 3)] * cluster.world
    c.unmap([1, 3])
    c.map([])  # nothing to do: no message
    cluster.assert_agree(pool, [])
    assert c.consistent and c.pending_commits == ()


def test_bad_pages_change_nothing(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([4])
    with pytest.raises(ValueError, match="not an integer"):
        c.map([c.num_pages])
    with pytest.raises(ValueError, match="duplicate"):
        c.map([1, 1])
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="not an integer"):
            c.map([2, bad])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="rolled back on every rank"):
        c.map([5, 4])  # 4 is mapped: every rank refuses, nothing changes
    with pytest.raises(ValueError, match="not mapped"):
        c.unmap([4, 6])
    cluster.assert_agree(pool, [4])
    assert c.consistent


def test_map_failing_on_one_rank_is_rolled_back_on_the_others(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([0])
    cluster.ctl(1, "fail", pool, "create", 2, 1, "oom")  # rank 1 runs out on the second page
    with pytest.raises(PoolExhausted, match="rank 1 EXHAUSTED"):
        c.map([2, 3, 4])
    cluster.assert_agree(pool, [0])
    c.map([2, 3, 4])  # the fault was one-shot: the pool works on
    cluster.assert_agree(pool, [0, 2, 3, 4])


def test_prepare_failing_on_one_rank_is_aborted_on_the_others(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([1, 2])
    cluster.ctl(2, "fail", pool, "unmap", 1, 1, "error")
    with pytest.raises(_vmm.BackendError, match="rolled back on every rank: rank 2 BACKEND"):
        c.unmap([1, 2])
    assert c.consistent
    cluster.assert_agree(pool, [1, 2])  # ranks 0 and 1 restored their pages
    c.unmap([1, 2])
    cluster.assert_agree(pool, [])


def test_failed_rollback_enters_the_error_state(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    cluster.ctl(1, "fail", pool, "create", 1, 1, "oom")  # rank 1 cannot map ...
    # ... and rank 0 cannot undo its map (its map unmapped the zero page: unmap call 1; the undo is call 2)
    cluster.ctl(0, "fail", pool, "unmap", 2, 1, "error")
    with pytest.raises(StateConsistencyError, match="rank 0 INCONSISTENT"):
        c.map([3])
    assert not c.consistent
    with pytest.raises(StateConsistencyError, match=r"consistency-error state.*rollback"):
        c.map([4])  # every later call refuses, with the reason
    with pytest.raises(StateConsistencyError):
        c.unmap([3])
    _assert_reclaimable(cluster, pool)


def test_failed_abort_enters_the_error_state(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([5])
    cluster.ctl(1, "fail", pool, "unmap", 1, 1, "error")  # rank 1 cannot prepare ...
    # ... and rank 0 cannot restore (its prepare mapped the zero page: map call 1; the abort's is call 2)
    cluster.ctl(0, "fail", pool, "map", 2, 1, "error")
    with pytest.raises(StateConsistencyError, match="abort"):
        c.unmap([5])
    assert not c.consistent
    _assert_reclaimable(cluster, pool)


def test_driver_error_during_map_is_rolled_back_everywhere(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    cluster.ctl(0, "fail", pool, "map", 2, 1, "error")  # not memory: BackendError, as LocalMapper raises it
    with pytest.raises(_vmm.BackendError, match="rank 0 BACKEND"):
        c.map([1, 2, 3])
    assert c.consistent
    cluster.assert_agree(pool, [])


def test_release_failing_during_commit_is_quarantined_not_diverged(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool)
    c.map([6, 7])
    cluster.ctl(2, "fail", pool, "release", 1, 1, "error")
    c.unmap([6, 7])  # commit cannot fail in the data plane: the handle it could not release is set aside
    assert c.consistent and c.pending_commits == ()
    snaps = cluster.snapshots(pool)
    assert {s[0] for s in snaps.values()} == {()}
    assert cluster.ctl(2, "failed_releases", pool) == 1
    cluster.assert_no_leaks(pool, ranks=[0, 1])
    baselines, _ = cluster.pools[pool]
    assert snaps[2][1] == baselines[2] + 1  # the one handle the backend refused to release, and nothing else


def test_handshake_refuses_ranks_that_diverge(cluster: Cluster, pool: int) -> None:
    cluster.ctl(1, "map_local", pool, [9])
    with pytest.raises(StateConsistencyError, match="ranks 0 and 1 map different pages"):
        cluster.coordinator(pool)


def test_a_new_coordinator_continues_where_the_last_one_stopped(cluster: Cluster, pool: int) -> None:
    first = cluster.coordinator(pool)
    first.map([1])
    first.unmap([1])
    second = cluster.coordinator(pool)  # transaction ids continue above every rank's last one
    second.map([1, 2])
    second.unmap([2])
    cluster.assert_agree(pool, [1])
    assert isinstance(second, Coordinator) and second.consistent


def _assert_reclaimable(cluster: Cluster, pool: int) -> None:
    """After the error state: tearing the pool down on every living rank gives every handle back."""
    for r in range(cluster.world):
        if cluster.alive(r):
            live, empty = cluster.ctl(r, "drop_pool", pool)
            assert live == empty, f"rank {r} leaks {live - empty} handles"
