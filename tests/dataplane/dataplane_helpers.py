"""Helpers shared by the data-plane tests (imported by name: pytest puts this folder on sys.path).

Everything here works on any backend whose memory torch can view through DLPack (host: CPU tensors; cuda:
CUDA tensors), so the same behaviour tests run on the host backend in CI and on the CUDA backend in ci/gpu.sh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from elastic_kv import _vmm

MiB = 1 << 20


@dataclass
class Rig:
    """A backend, a pool, some spaces and a group over them, plus torch views of the spaces."""

    backend: _vmm.Backend
    pool: _vmm.HandlePool
    spaces: list[_vmm.TensorSpace]
    group: _vmm.SpaceGroup
    extents: list[tuple[int, int, int, int]]
    views: list[torch.Tensor]
    # Checks read every `check_step`-th byte: 1 reads everything; the fault-injection suite samples (one byte
    # per 64 KiB still catches any misplaced page, and skips most of the page faults of fresh mappings).
    check_step: int = 1
    # The salt of the last write_page per page (threads write distinct pages; dict updates hold the GIL).
    salts: dict[int, int] = field(default_factory=dict)

    def page_ranges(self, page: int) -> list[tuple[int, int, int]]:
        """(space, start, end) byte ranges of a logical page, one per extent."""
        return [
            (s, base + page * step, base + page * step + length) for s, base, step, length in self.extents
        ]

    def write_page(self, page: int, salt: int = 0) -> None:
        """Fills every byte range of `page` with its pattern value."""
        self.salts[page] = salt
        for s, lo, hi in self.page_ranges(page):
            self.views[s][lo:hi].fill_(pattern(page, s, salt))
        self.sync()

    def sync(self) -> None:
        """Waits for queued device work: a page must not be unmapped under a kernel still writing it (the
        ledger's deferred free guarantees that in production; tests do it by hand)."""
        if any(v.is_cuda for v in self.views):
            torch.cuda.synchronize()

    def page_intact(self, page: int, salt: int = 0) -> bool:
        """True if every byte range of `page` still holds its pattern value."""
        for s, lo, hi in self.page_ranges(page):
            if not bool((self.views[s][lo : hi : self.check_step] == pattern(page, s, salt)).all()):
                return False
        return True

    def holds_last_write(self, page: int) -> bool:
        """True if `page` still holds what the last write_page(page) wrote."""
        return self.page_intact(page, self.salts[page])

    def page_zero(self, page: int) -> bool:
        """True if every byte range of `page` reads zeros."""
        step = self.check_step
        return all(
            int(self.views[s][lo:hi:step].count_nonzero()) == 0 for s, lo, hi in self.page_ranges(page)
        )

    def slot_states(self) -> list[list[str]]:
        return [[sp.slot_state(i) for i in range(sp.num_slots)] for sp in self.spaces]

    def zero_slots_read_zero(self) -> bool:
        """Every slot in state "zero" reads zeros (nobody wrote through the zero page)."""
        for sp, view in zip(self.spaces, self.views, strict=True):
            for i in range(sp.num_slots):
                if sp.slot_state(i) == "zero":
                    chunk = view[i * sp.page_size : (i + 1) * sp.page_size : self.check_step]
                    if int(chunk.count_nonzero()) != 0:
                        return False
        return True

    def close(self) -> None:
        self.group.close()


def pattern(page: int, space: int, salt: int = 0) -> int:
    """A non-zero byte value per (page, space), so that misplaced data is detected."""
    return (page * 31 + space * 7 + salt * 13) % 251 + 1


def make_rig(
    backend: _vmm.Backend,
    *,
    num_pages: int = 8,
    page_size: int = 2 * MiB,
    extents: Sequence[tuple[int, int, int, int]] | None = None,
    space_sizes: Sequence[int] | None = None,
    max_cached_bytes: int = 64 * MiB,
    history: int = 1024,
    pool: _vmm.HandlePool | None = None,
    view: Callable[[_vmm.TensorSpace], torch.Tensor] = torch.from_dlpack,
) -> Rig:
    """Builds a group; by default one space with one slot-aligned page per slot, and a pool of its own.
    `view` turns a space into a byte tensor (DLPack by default; the fake-driver tests view host memory)."""
    if extents is None:
        extents = [(0, 0, page_size, page_size)]
    if space_sizes is None:
        n_spaces = max(e[0] for e in extents) + 1
        space_sizes = []
        for s in range(n_spaces):
            end = max(base + (num_pages - 1) * step + length for sp, base, step, length in extents if sp == s)
            space_sizes.append(end)
    spaces = [_vmm.TensorSpace(backend, size, page_size) for size in space_sizes]
    if pool is None:
        pool = _vmm.HandlePool(backend, max_cached_bytes)
    group = _vmm.SpaceGroup(spaces, list(extents), num_pages, pool, history)
    views = [view(sp) for sp in spaces]
    return Rig(backend, pool, spaces, group, list(extents), views)


def expected_live_handles(rig: Rig, baseline: int) -> int:
    """What backend.live_handles must be: the baseline (zero pages) plus what the pool and group hold."""
    return (
        baseline
        + rig.pool.cached_handles
        + rig.pool.failed_releases
        + rig.group.held_handles
        + rig.group.quarantined_handles
    )
