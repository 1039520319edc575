"""The worker's parking target on the host data plane (``vllm_elastic_kv.worker.parking``): what a sleep that
keeps its requests does to the KV pages, and what the ledger may still ask of the rank meanwhile. The engine
path (a real vLLM server's ``/sleep?level=1&mode=keep``) is ``test_vllm_serve.py``'s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from elastic_kv import _vmm
from elastic_kv.geometry import BlockFamily, BlockGeometry
from elastic_kv.host import HostArena
from vllm_elastic_kv.worker.parking import ParkingTarget, page_ranges
from vllm_elastic_kv.worker.sleep import PinnedArena

pytestmark = pytest.mark.vllm

KIB = 1024
PAGE = 4 * KIB


class _Calls:
    """Counts the copies a parking issues (each ``Tensor.copy_`` into or out of the host copy)."""

    def __init__(self) -> None:
        self.copies = 0


@contextlib.contextmanager
def _target(arena: HostArena | None = None) -> Iterator[tuple[ParkingTarget, Any, torch.Tensor]]:
    """A parking target over one space of 16 pages, two interleaved block families (a block's bytes are not
    one run), block 0's page resident; every page's bytes filled with its number + 1."""
    backend = _vmm.HostBackend()
    space = _vmm.TensorSpace(backend, 16 * PAGE, PAGE)
    geo = BlockGeometry(
        [16 * PAGE], [BlockFamily(0, 0, 2 * KIB, KIB), BlockFamily(0, KIB, 2 * KIB, KIB)], 32, PAGE
    )
    group = _vmm.SpaceGroup([space], geo.extent_tuples(), geo.num_pages, _vmm.HandlePool(backend, 0))
    flat = torch.from_dlpack(space)
    pinned = None if arena is None else PinnedArena(arena)  # on a CPU nothing is page-locked
    target = ParkingTarget(
        group,
        group,
        geo,
        [flat],
        contextlib.nullcontext,
        arena=pinned,
        owner="park-test",
        resident=frozenset({0}),
    )
    try:
        yield target, group, flat
    finally:
        target.close()


def _fill(flat: torch.Tensor, geo_pages: range) -> None:
    for p in geo_pages:
        flat[p * PAGE : (p + 1) * PAGE] = p + 1


def _page(flat: torch.Tensor, p: int) -> torch.Tensor:
    return flat[p * PAGE : (p + 1) * PAGE]


def test_a_parked_page_gives_its_memory_back_and_comes_back_with_its_blocks() -> None:
    with _target() as (target, group, flat):
        target.map(range(6))
        _fill(flat, range(6))
        parked = target.park()
        assert parked == 5 * PAGE  # every page but block 0's
        assert group.num_mapped == 1 and target.num_mapped == 6  # the rank still answers for all six
        assert target.is_mapped(3) and target.mapped_pages() == list(range(6))
        assert not bool(_page(flat, 3).any())  # unmapped: the space shows the zero page
        assert bool((_page(flat, 0) == 1).all())  # the resident page stays
        assert target.park() == parked  # parked already: nothing more
        target.unpark()
        assert group.num_mapped == 6 and target.parked_bytes == 0
        assert all(bool((_page(flat, p) == p + 1).all()) for p in range(6))


def test_pages_the_ledger_releases_while_parked_are_dropped_not_restored() -> None:
    """An aborted request's pages (an unmap), and a two-phase unmap (prepare, then commit or abort), reach
    parked pages through the target, which answers for them without the data plane."""
    with _target() as (target, group, flat):
        target.map(range(7))
        _fill(flat, range(7))
        target.park()
        target.unmap([2])  # dropped
        target.prepare(11, [3, 4])
        target.commit(11)  # dropped
        target.prepare(12, [5])
        target.abort(12)  # still parked
        assert target.mapped_pages() == [0, 1, 5, 6]
        target.unpark()
        assert group.mapped_pages() == [0, 1, 5, 6]
        assert all(bool((_page(flat, p) == p + 1).all()) for p in (0, 1, 5, 6))
        assert not any(bool(_page(flat, p).any()) for p in (2, 3, 4))
        target.map([2])  # the ledger may map a dropped page again: a real map
        assert group.num_mapped == 5


def test_a_release_that_drops_every_parked_page_gives_the_host_copy_back(tmp_path: Any) -> None:
    arena = HostArena.create(tmp_path / "a.arena", 64 * PAGE, prefault=False)
    try:
        with _target(arena) as (target, _group, flat):
            target.map(range(4))
            _fill(flat, range(4))
            target.park()
            (extent,) = arena.extents()
            assert extent.owner == "park-test"
            target.unmap([1, 2, 3])
            assert arena.extents() == [] and target.parked_bytes == 0
            target.unpark()  # nothing left to bring back
    finally:
        arena.close()
        arena.remove()


def test_neighbouring_pages_are_copied_as_one_range_per_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page by page, 5 pages of 2 families of interleaved blocks would be 5 x 2 x 8 copies each way; the
    host copy holds them in device order, so each run of neighbouring pages costs one copy a family run."""
    copies = _Calls()
    original = torch.Tensor.copy_

    def counted(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.copies += 1
        return original(self, src, non_blocking)

    with _target() as (target, _group, flat):
        target.map(range(6))
        _fill(flat, range(6))
        per_page = len(list(page_ranges(target._geo, [1])))
        monkeypatch.setattr(torch.Tensor, "copy_", counted)
        target.park()
        out = copies.copies
        target.unpark()
        monkeypatch.undo()
        assert out < 5 * per_page and copies.copies - out == out, (out, copies.copies, per_page)
        assert all(bool((_page(flat, p) == p + 1).all()) for p in range(6))
