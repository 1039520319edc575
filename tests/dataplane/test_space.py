"""TensorSpace: reservation, zero page, DLPack export, lifetime."""

from __future__ import annotations

import gc

import pytest
import torch
from dataplane_helpers import MiB, make_rig
from elastic_kv import _vmm


def test_space_reserves_rounded_range_with_every_slot_on_the_zero_page(make_backend) -> None:
    backend = make_backend()
    space = _vmm.TensorSpace(backend, 5 * MiB, 2 * MiB)
    assert space.size == 6 * MiB and space.num_slots == 3 and space.page_size == 2 * MiB
    assert space.base % (2 * MiB) == 0
    assert [space.slot_state(i) for i in range(3)] == ["zero"] * 3
    assert backend.live_handles == 1  # one shared zero page, not one per slot
    view = torch.from_dlpack(space)
    assert view.dtype == torch.uint8 and view.shape == (6 * MiB,) and view.data_ptr() == space.base
    assert int(view.count_nonzero()) == 0


def test_dlpack_device_matches_backend(make_backend) -> None:
    backend = make_backend()
    space = _vmm.TensorSpace(backend, 2 * MiB, 2 * MiB)
    kind, index = backend.device
    assert space.__dlpack_device__() == ({"cpu": 1, "cuda": 2, "rocm": 10}[kind], index)
    with pytest.raises(BufferError):
        space.__dlpack__(dl_device=(99, 0))


def test_tensor_keeps_space_alive_and_base_never_moves(make_backend) -> None:
    backend = make_backend()
    space = _vmm.TensorSpace(backend, 4 * MiB, 2 * MiB)
    base = space.base
    view = torch.from_dlpack(space)
    del space
    gc.collect()
    assert backend.live_reservations == 1  # the tensor still holds the space
    assert view.data_ptr() == base and int(view[: 4 * MiB].count_nonzero()) == 0
    del view
    gc.collect()
    assert backend.live_reservations == 0 and backend.live_handles == 0


def test_unconsumed_capsule_releases_its_reference(make_backend) -> None:
    backend = make_backend()
    space = _vmm.TensorSpace(backend, 2 * MiB, 2 * MiB)
    capsule = space.__dlpack__()
    del space, capsule
    gc.collect()
    assert backend.live_reservations == 0


def test_zero_page_aliasing_a_stray_write_shows_in_every_unbacked_slot(make_backend) -> None:
    """The documented hazard: the zero page is shared, so a write into one unbacked slot appears in all."""
    rig = make_rig(make_backend(), num_pages=4)
    view = rig.views[0]
    rig.group.map([1])
    rig.write_page(1)
    view[0:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=view.device)  # page 0 is unbacked
    for slot in (0, 2, 3):  # every unbacked slot of that size sees the stray bytes
        assert view[slot * 2 * MiB : slot * 2 * MiB + 4].tolist() == [1, 2, 3, 4]
    assert rig.page_intact(1)  # a backed page does not
    view[0:4] = 0  # clean up the shared zero page again
    rig.sync()
    rig.close()


def test_mapped_slot_keeps_data_unmapped_slot_reads_zeros(make_backend) -> None:
    rig = make_rig(make_backend(), num_pages=4)
    rig.group.map([0, 2])
    rig.write_page(0)
    rig.write_page(2)
    assert rig.page_intact(0) and rig.page_intact(2)
    assert rig.page_zero(1) and rig.page_zero(3)
    rig.group.unmap([0])
    assert rig.page_zero(0) and rig.page_intact(2)
    assert rig.slot_states() == [["zero", "zero", "mapped", "zero"]]
    rig.close()


def test_bad_space_arguments_raise_value_error(make_backend) -> None:
    backend = make_backend()
    with pytest.raises(ValueError, match="multiple of the backend granularity"):
        _vmm.TensorSpace(backend, 4 * MiB, 3 * MiB)
    with pytest.raises(ValueError):
        _vmm.TensorSpace(backend, 4 * MiB, 0)
    with pytest.raises(ValueError):
        _vmm.TensorSpace(backend, 0, 2 * MiB)
    with pytest.raises(ValueError):
        _vmm.TensorSpace(backend, -1, 2 * MiB)
    space = _vmm.TensorSpace(backend, 2 * MiB, 2 * MiB)
    with pytest.raises(ValueError):
        space.slot_state(1)
    with pytest.raises(ValueError):
        space.slot_state(-1)
    assert backend.live_reservations == 1 and backend.live_handles == 1
