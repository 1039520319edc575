"""SpaceGroup: logical pages over spaces, compound units, shared slots, all-or-nothing batches."""

from __future__ import annotations

import pytest
from dataplane_helpers import MiB, expected_live_handles, make_rig
from elastic_kv import _vmm
from elastic_kv.errors import PoolExhausted


@pytest.mark.parametrize("multi_unmap", [True, False])
def test_map_unmap_batches_through_torch(make_backend, multi_unmap: bool) -> None:
    backend = make_backend(multi_unmap=multi_unmap)
    rig = make_rig(backend, num_pages=16)
    baseline = backend.live_handles
    rig.group.map([3, 4, 5, 9])
    assert rig.group.mapped_pages() == [3, 4, 5, 9] and rig.group.num_mapped == 4
    assert rig.group.mapped_bytes == 4 * 2 * MiB
    for p in (3, 4, 5, 9):
        rig.write_page(p)
    rig.group.unmap([4, 9])
    assert rig.page_intact(3) and rig.page_intact(5) and rig.page_zero(4) and rig.page_zero(9)
    assert [rig.group.page_state(p) for p in (3, 4)] == ["mapped", "unmapped"]
    assert backend.live_handles == expected_live_handles(rig, baseline)
    assert rig.zero_slots_read_zero()
    rig.close()
    assert rig.group.closed and backend.live_handles == baseline + rig.pool.cached_handles


def test_per_layer_spaces_map_a_page_in_every_space(make_backend) -> None:
    """SGLang's layout: one K and one V buffer per layer, page p at the same offset in each."""
    layers = 3
    extents = [(s, 0, 2 * MiB, 2 * MiB) for s in range(2 * layers)]
    rig = make_rig(make_backend(), num_pages=4, extents=extents)
    rig.group.map([2])
    assert [sp.slot_state(2) for sp in rig.spaces] == ["mapped"] * (2 * layers)
    assert [sp.slot_state(1) for sp in rig.spaces] == ["zero"] * (2 * layers)
    assert rig.group.mapped_bytes == 2 * layers * 2 * MiB
    assert len(rig.group.page_units(2)) == 2 * layers
    rig.write_page(2)
    assert rig.page_intact(2)
    rig.close()


def test_aligned_extent_gets_one_compound_handle_per_page(make_backend) -> None:
    """vLLM-like layout: page p is one contiguous 3-slot run; one handle backs it (driver cost per handle)."""
    backend = make_backend()
    rig = make_rig(backend, num_pages=4, extents=[(0, 0, 6 * MiB, 6 * MiB)])
    assert rig.group.num_units == 4
    assert rig.group.page_units(1) == [(0, 3, 3)]
    creates = backend.calls("create")
    maps = backend.calls("map")
    rig.group.map([1])
    assert backend.calls("create") - creates == 1  # one 6 MiB handle, not three 2 MiB ones
    assert backend.calls("map") - maps == 1
    assert [rig.spaces[0].slot_state(i) for i in range(12)] == ["zero"] * 3 + ["mapped"] * 3 + ["zero"] * 6
    rig.write_page(1)
    assert rig.page_intact(1) and rig.page_zero(0) and rig.zero_slots_read_zero()
    rig.group.unmap([1])
    assert rig.page_zero(1)
    rig.close()


def test_strided_layers_in_one_buffer_share_no_handle(make_backend) -> None:
    """One buffer with a layer stride: page p touches one slot per layer; each slot is its own unit."""
    layers, num_pages = 3, 4
    layer_stride = num_pages * 2 * MiB
    extents = [(0, layer * layer_stride, 2 * MiB, 2 * MiB) for layer in range(layers)]
    rig = make_rig(make_backend(), num_pages=num_pages, extents=extents)
    rig.group.map([1, 3])
    states = rig.slot_states()[0]
    assert [i for i, s in enumerate(states) if s == "mapped"] == [1, 3, 5, 7, 9, 11]
    for p in (1, 3):
        rig.write_page(p)
    rig.group.unmap([1])
    assert rig.page_zero(1) and rig.page_intact(3)
    rig.close()


def test_shared_slot_stays_backed_while_any_page_touching_it_is_mapped(make_backend) -> None:
    """Pages of 3 MiB over 2 MiB slots: page 0 = [0,3) MiB, page 1 = [3,6) MiB share slot 1 ([2,4) MiB)."""
    backend = make_backend()
    rig = make_rig(backend, num_pages=4, extents=[(0, 0, 3 * MiB, 3 * MiB)])
    assert rig.group.page_units(0) == [(0, 0, 1), (0, 1, 1)]
    assert rig.group.page_units(1) == [(0, 1, 1), (0, 2, 1)]
    rig.group.map([0, 1])
    assert rig.group.mapped_bytes == 3 * 2 * MiB  # the shared slot counts once
    rig.write_page(0)
    rig.write_page(1)
    rig.group.unmap([0])
    assert rig.slot_states()[0][:3] == ["zero", "mapped", "mapped"]
    assert rig.page_intact(1)  # including its half of the shared slot
    assert rig.group.mapped_bytes == 2 * 2 * MiB
    rig.group.map([0])  # the shared slot is already backed: only slot 0 is new
    assert rig.group.mapped_bytes == 3 * 2 * MiB and rig.page_intact(1)
    rig.group.unmap([0, 1])
    assert rig.slot_states()[0] == ["zero"] * rig.spaces[0].num_slots
    assert rig.group.held_handles == 0
    rig.close()


def test_map_is_all_or_nothing_on_out_of_memory(make_backend) -> None:
    backend = make_backend(physical_budget=3 * 2 * MiB + 2 * MiB)  # zero page + 3 pages
    rig = make_rig(backend, num_pages=8, max_cached_bytes=0)
    baseline = backend.live_handles
    rig.group.map([0])
    rig.write_page(0)
    with pytest.raises(PoolExhausted):
        rig.group.map([1, 2, 3, 4])
    assert rig.group.mapped_pages() == [0] and rig.group.consistent
    assert rig.page_intact(0) and all(rig.page_zero(p) for p in range(1, 8))
    assert backend.live_handles == expected_live_handles(rig, baseline)
    rig.group.map([1, 2])  # what fits still maps
    assert rig.group.mapped_pages() == [0, 1, 2]
    rig.close()


def test_two_groups_cannot_share_a_space(make_backend) -> None:
    backend = make_backend()
    space = _vmm.TensorSpace(backend, 4 * MiB, 2 * MiB)
    pool = _vmm.HandlePool(backend, 0)
    group = _vmm.SpaceGroup([space], [(0, 0, 2 * MiB, 2 * MiB)], 2, pool)
    with pytest.raises(ValueError, match="already belongs"):
        _vmm.SpaceGroup([space], [(0, 0, 2 * MiB, 2 * MiB)], 2, pool)
    group.map([0])
    group.close()
    again = _vmm.SpaceGroup([space], [(0, 0, 4 * MiB, 4 * MiB)], 1, pool)  # re-tiled as one 4 MiB unit
    again.map([0])
    assert [space.slot_state(i) for i in range(2)] == ["mapped", "mapped"]
    again.close()


def test_closing_returns_units_to_zero_and_handles_to_pool(make_backend) -> None:
    backend = make_backend()
    rig = make_rig(backend, num_pages=4)
    rig.group.map([0, 1])
    rig.write_page(0)
    rig.group.close()
    assert rig.slot_states() == [["zero"] * 4] and rig.page_zero(0)  # tensors stay readable
    assert rig.pool.cached_handles == 2
    with pytest.raises(ValueError, match="closed"):
        rig.group.map([2])
    rig.group.close()  # idempotent
