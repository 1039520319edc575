"""Two-phase unmap: prepare / commit / abort, idempotence, bounded history, shared slots."""

from __future__ import annotations

import pytest
from dataplane_helpers import MiB, expected_live_handles, make_rig
from elastic_kv import _vmm
from elastic_kv.errors import PoolExhausted


def test_prepare_unmaps_and_abort_restores_the_same_memory(make_backend) -> None:
    backend = make_backend()
    rig = make_rig(backend, num_pages=8)
    rig.group.map([1, 2, 3])
    for p in (1, 2, 3):
        rig.write_page(p)
    rig.group.prepare(7, [1, 2])
    assert rig.group.tx_state(7) == "prepared"
    assert [rig.group.page_state(p) for p in (1, 2, 3)] == ["prepared", "prepared", "mapped"]
    assert rig.page_zero(1) and rig.page_zero(2) and rig.page_intact(3)
    assert rig.group.held_handles == 3 and rig.group.mapped_bytes == 2 * MiB  # handles retained, not mapped
    rig.group.abort(7)
    assert rig.group.tx_state(7) == "aborted" and rig.group.mapped_pages() == [1, 2, 3]
    assert rig.page_intact(1) and rig.page_intact(2) and rig.page_intact(3)  # same handles, same bytes
    rig.group.abort(7)  # idempotent
    rig.close()


def test_commit_gives_handles_back_and_is_idempotent(make_backend) -> None:
    backend = make_backend()
    rig = make_rig(backend, num_pages=8)
    baseline = backend.live_handles
    rig.group.map([0, 1])
    rig.group.prepare(1, [0, 1])
    rig.group.commit(1)
    rig.group.commit(1)
    assert rig.group.tx_state(1) == "committed" and rig.group.mapped_pages() == []
    assert rig.group.held_handles == 0 and rig.pool.cached_handles == 2
    assert backend.live_handles == expected_live_handles(rig, baseline)
    rig.close()


def test_outcomes_conflict_and_late_prepare_is_refused(make_backend) -> None:
    rig = make_rig(make_backend(), num_pages=8)
    rig.group.map([0, 1, 2])
    rig.group.prepare(1, [0])
    rig.group.commit(1)
    with pytest.raises(ValueError, match="committed"):
        rig.group.abort(1)
    with pytest.raises(ValueError, match="committed"):
        rig.group.prepare(1, [1])
    rig.group.prepare(2, [1])
    rig.group.abort(2)
    with pytest.raises(ValueError, match="aborted"):
        rig.group.commit(2)
    # Presumed abort: the coordinator aborts tx 3 before this rank ever saw its prepare.
    rig.group.abort(3)
    assert rig.group.tx_state(3) == "aborted"
    with pytest.raises(ValueError, match="late prepare"):
        rig.group.prepare(3, [2])
    assert rig.group.page_state(2) == "mapped"
    with pytest.raises(ValueError, match="unknown tx"):
        rig.group.commit(99)
    rig.close()


def test_history_is_bounded(make_backend) -> None:
    rig = make_rig(make_backend(), num_pages=8, history=2)
    rig.group.map([0, 1, 2])
    for tx, page in ((10, 0), (11, 1), (12, 2)):
        rig.group.prepare(tx, [page])
        rig.group.commit(tx)
    assert rig.group.tx_state(10) is None  # forgotten
    assert rig.group.tx_state(11) == "committed" and rig.group.tx_state(12) == "committed"
    rig.close()


def test_prepared_pages_cannot_be_mapped_or_unmapped(make_backend) -> None:
    rig = make_rig(make_backend(), num_pages=8)
    rig.group.map([0])
    rig.group.prepare(5, [0])
    with pytest.raises(ValueError, match="prepared transaction"):
        rig.group.map([0])
    with pytest.raises(ValueError, match="prepared transaction"):
        rig.group.unmap([0])
    with pytest.raises(ValueError, match="already prepared"):
        rig.group.prepare(5, [])
    rig.close()


def test_abort_restores_a_shared_slot_without_allocating(make_backend) -> None:
    """Page 0 = [0,3) MiB and page 1 = [3,6) MiB share slot 1. Page 0 is prepared, then page 1 unmapped:
    the shared slot goes back to the zero page, but its handle stays with the prepared transaction, so abort
    needs no new memory even when the budget is exhausted."""
    backend = make_backend(physical_budget=2 * MiB + 3 * 2 * MiB)  # zero page + exactly 3 slots
    rig = make_rig(backend, num_pages=2, extents=[(0, 0, 3 * MiB, 3 * MiB)], max_cached_bytes=0)
    rig.group.map([0, 1])
    rig.write_page(0)
    rig.write_page(1)
    rig.group.prepare(1, [0])
    assert rig.slot_states()[0] == ["zero", "mapped", "mapped"]
    rig.group.unmap([1])
    assert rig.slot_states()[0] == ["zero", "zero", "zero"]
    assert rig.group.held_handles == 2  # slots 0 and 1 retained by tx 1; slot 2 released
    # Someone else takes the last free 2 MiB: the budget is now exhausted.
    other = _vmm.SpaceGroup(
        [_vmm.TensorSpace(backend, 2 * MiB, 2 * MiB)], [(0, 0, 2 * MiB, 2 * MiB)], 1, rig.pool
    )
    other.map([0])
    rig.group.abort(1)
    assert rig.slot_states()[0] == ["mapped", "mapped", "zero"]
    assert rig.page_intact(0)
    with pytest.raises(PoolExhausted):
        rig.group.map([1])
    other.close()
    rig.close()


def test_mapping_a_neighbour_reuses_the_retained_handle_and_commit_keeps_it(make_backend) -> None:
    backend = make_backend()
    rig = make_rig(backend, num_pages=2, extents=[(0, 0, 3 * MiB, 3 * MiB)])
    rig.group.map([0])
    rig.write_page(0)
    rig.group.prepare(1, [0])  # slots 0 and 1 unbacked, handles retained
    creates = backend.calls("create")
    rig.group.map([1])  # needs slots 1 and 2: slot 1 comes back with the retained handle
    assert backend.calls("create") - creates == 1 and rig.pool.hits == 0
    rig.group.commit(1)  # slot 0's handle goes to the pool; slot 1's stays (page 1 maps it)
    assert rig.slot_states()[0] == ["zero", "mapped", "mapped"]
    assert rig.group.held_handles == 2 and rig.pool.cached_handles == 1
    rig.close()
