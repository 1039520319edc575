"""A suspended engine's KV cache kept in host memory: the worker's half of a sleep that keeps its requests.

vLLM's sleep with ``mode=keep`` pauses the scheduler with its requests and resets the prefix cache, which
preempts the running requests: their KV is freed with the rest of the memory, and after the wake-up every
one of them is computed again from its prompt and the tokens it had generated. For an engine suspended with
a hundred requests of a few thousand tokens each, that is a few hundred thousand tokens of prefill before
its next decode step, paid at every turn it takes.

Parked instead, with ``park_kv`` (``ELASTIC_KV_PARK_KV=1``: for engines whose weights do not change while they
sleep, as ``elastic-kv serve`` starts them; vLLM's own behaviour above otherwise): the scheduler leaves the
running requests as they are
(:meth:`vllm_elastic_kv.scheduler.scheduler.ElasticSchedulerMixin.reset_prefix_cache` while paused with
``keep``); the worker's ``sleep`` copies the blocks of every page mapped now to host memory and unmaps the
pages, so their memory goes back to the driver (:meth:`ParkingTarget.park`); its ``wake_up`` maps them again
and copies the blocks back before the scheduler resumes (:meth:`ParkingTarget.unpark`). The requests go on
from the token they had reached.

The ledger is not told: in its book the pages stay mapped and their charge stays on the pool's record, so
nothing of its state changes while the engine sleeps. What it may still ask of the rank meanwhile -- a
request aborted by its client empties pages, ``kvctl`` trims the reserve -- reaches the parked pages through
this target, which answers for them without the data plane: an unmap of a parked page drops its copy. The
physical bytes parked are what :meth:`ParkingTarget.parked_bytes` says (the worker's ``elastic_kv_info``),
which ``elastic-kv serve`` reads to give them to other models while this one sleeps.

Host memory: an extent of the host arena where the engine has one (``ELASTIC_KV_HOST_ARENA``, as under
``elastic-kv serve``, which bounds it), else a buffer of its own (page-locked on GPUs). Where neither can be
had, the pages stay mapped: the requests are kept all the same, only their memory is not given back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from elastic_kv.errors import PoolExhausted
from elastic_kv.geometry import BlockGeometry
from elastic_kv.host import Extent, HostArena

__all__ = ["ParkingTarget", "block_ranges", "page_ranges"]

logger = logging.getLogger(__name__)


def block_ranges(geometry: BlockGeometry, blocks: range) -> Iterator[tuple[int, int, int]]:
    """The byte ranges that hold the consecutive ``blocks``: ``(space, start, stop)`` per family (one range
    where the family is dense, else one per block), in one fixed order; exact block bytes, nothing of a
    neighbour's."""
    for fam in geometry.families:
        if fam.stride == fam.nbytes:  # dense: the blocks are one byte range
            yield fam.space, fam.base + blocks.start * fam.stride, fam.base + blocks.stop * fam.stride
        else:
            for b in blocks:
                lo = fam.base + b * fam.stride
                yield fam.space, lo, lo + fam.nbytes


def page_ranges(geometry: BlockGeometry, pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """:func:`block_ranges` of each of ``pages``' blocks, page by page in ascending order."""
    for page in sorted(pages):
        blocks = geometry.blocks_of(page)
        if len(blocks):
            yield from block_ranges(geometry, blocks)


_Span = tuple[int, int, int, int]  # (space, start, stop) on the device, and the offset in the host copy


def _merged(spans: Iterable[_Span]) -> list[_Span]:
    """``spans`` sorted, neighbours merged: one range where both the device bytes and the host copy's are
    contiguous (what copying page by page would split into a copy per page and family)."""
    out: list[_Span] = []
    for space, lo, hi, at in sorted(spans):
        if out:
            s, l0, h0, a0 = out[-1]
            if s == space and h0 == lo and a0 + (h0 - l0) == at:
                out[-1] = (s, l0, hi, a0)
                continue
        out.append((space, lo, hi, at))
    return out


class _HostCopy:
    """Host memory for one parking: an arena extent, or a buffer of this process."""

    def __init__(self, nbytes: int, arena: Any, owner: str, pinned: bool) -> None:
        self.extent: Extent | None = None
        self._arena = arena
        if arena is not None:
            store: HostArena = arena.arena
            self.extent = store.take(nbytes, owner)
            if self.extent is None:
                raise MemoryError(f"the host arena {store.path} has no room for {nbytes} bytes")
            if pinned:
                arena.pin_extent(self.extent)
            self.buffer = arena.view(self.extent)[:nbytes]
        else:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def release(self) -> None:
        """Give the memory back (the arena's extent to the arena)."""
        if self.extent is not None:
            self._arena.arena.give_back(self.extent)
            self.extent = None
        self.buffer = torch.empty(0, dtype=torch.uint8)


class ParkingTarget:
    """The rank's target (the ``SpaceGroup``, or the zeroing target over it) with parking added: every
    call is the inner target's, except for parked pages, which it answers itself (see the module
    docstring). ``group``: the ``SpaceGroup`` under ``inner``, which maps the pages back without zeroing
    them (their blocks are copied back at once); ``flats``: one flat ``uint8`` tensor over each space;
    ``exclusive``: a callable that holds every rank request off while pages are parked or unparked (the
    rank's lock); ``arena``: the process's pinned host arena, if any; ``owner``: the name its extents
    go by; ``resident``: pages never parked (the null block's, which every sleep leaves mapped: a sleep
    that kept no request then parks nothing)."""

    def __init__(
        self,
        inner: Any,
        group: Any,
        geometry: BlockGeometry,
        flats: Sequence[torch.Tensor],
        exclusive: Callable[[], AbstractContextManager[Any]],
        *,
        arena: Any = None,
        owner: str = "",
        resident: frozenset[int] = frozenset(),
    ) -> None:
        self._inner = inner
        self._group = group
        self._geo = geometry
        self._flats = flats
        self._exclusive = exclusive
        self._arena = arena
        self._owner = owner
        self._resident = resident
        self._cuda = bool(flats) and flats[0].is_cuda
        # The parked pages (unmapped on the device, their blocks in the host copy): each page's ranges and
        # where the host copy holds them.
        self._parked: dict[int, list[_Span]] = {}
        self._copy: _HostCopy | None = None
        self._parked_bytes = 0
        self._prepared: dict[int, tuple[list[int], bool]] = {}  # tx -> (parked pages it drops, has others)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # -- parking ------------------------------------------------------------------------------------
    @property
    def parked_bytes(self) -> int:
        """Device bytes the parking gave back (0: nothing parked)."""
        return self._parked_bytes if self._parked else 0

    def park(self) -> int:
        """Copy the blocks of every mapped page but the resident ones to host memory and unmap the pages;
        the device bytes given back (0 where none is mapped or no host memory could be had: the pages then
        stay mapped)."""
        with self._exclusive():
            if self._parked:
                return self._parked_bytes
            pages = [p for p in self._inner.mapped_pages() if p not in self._resident]
            if not pages:
                return 0
            # The host copy holds the ranges in device order, space by space, so that neighbouring pages'
            # ranges are one copy each way (_merged).
            spans = sorted(
                (space, lo, hi, page) for page in pages for space, lo, hi in page_ranges(self._geo, [page])
            )
            by_page: dict[int, list[_Span]] = {page: [] for page in pages}
            placed: list[_Span] = []
            nbytes = 0
            for space, lo, hi, page in spans:
                placed.append((space, lo, hi, nbytes))
                by_page[page].append(placed[-1])
                nbytes += hi - lo
            t0 = time.perf_counter()
            try:
                copy = _HostCopy(nbytes, self._arena, self._owner, self._cuda)
            except (MemoryError, RuntimeError) as exc:
                logger.warning("KV cache not parked (%d pages stay mapped): %s", len(pages), exc)
                return 0
            try:
                for space, lo, hi, at in _merged(placed):
                    copy.buffer[at : at + hi - lo].copy_(self._flats[space][lo:hi], non_blocking=True)
                if self._cuda:
                    torch.cuda.synchronize(self._flats[0].device)
                before = self._inner.mapped_bytes
                self._inner.unmap(pages)
            except BaseException:
                copy.release()
                raise
            self._parked_bytes = before - self._inner.mapped_bytes
            self._parked, self._copy = by_page, copy
            logger.info(
                "KV cache parked: %d pages, %d bytes copied to host memory in %.3f s",
                len(pages), nbytes, time.perf_counter() - t0,
            )  # fmt: skip
            return self._parked_bytes

    def unpark(self, timeout_s: float = 600.0, poll_s: float = 0.05) -> None:
        """Map the parked pages again and copy their blocks back; the host memory goes back. While the
        device has no room for them (``PoolExhausted``: a neighbour took it), wait up to ``timeout_s``,
        then raise: the requests cannot go on without their blocks."""
        with self._exclusive():
            if not self._parked:
                return  # nothing parked, or every parked page dropped (its copy given back then)
            pages = sorted(self._parked)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    self._group.map(pages)
                    break
                except PoolExhausted:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(poll_s)
            copy = self._copy
            assert copy is not None
            for space, lo, hi, at in _merged(s for spans in self._parked.values() for s in spans):
                self._flats[space][lo:hi].copy_(copy.buffer[at : at + hi - lo], non_blocking=True)
            if self._cuda:
                torch.cuda.synchronize(self._flats[0].device)
            self._release_copy()
            logger.info("KV cache unparked: %d pages", len(pages))

    def _release_copy(self) -> None:
        """Nothing is parked any more: the host copy goes back."""
        if self._copy is not None:
            self._copy.release()
        self._copy = None
        self._parked = {}
        self._parked_bytes = 0

    def _drop(self, pages: Sequence[int]) -> list[int]:
        """Forget the parked ``pages`` among ``pages`` (their blocks are not restored); the others."""
        rest = [p for p in pages if self._parked.pop(p, None) is None]
        if not self._parked:
            self._release_copy()
        return rest

    # -- the rank's calls -----------------------------------------------------------------------------
    def unmap(self, pages: Sequence[int]) -> None:
        rest = self._drop(pages) if self._parked else list(pages)
        if rest:
            self._inner.unmap(rest)

    def prepare(self, tx: int, pages: Sequence[int]) -> None:
        parked = [p for p in pages if p in self._parked]
        if not parked:
            self._inner.prepare(tx, pages)
            return
        rest = [p for p in pages if p not in self._parked]
        if rest:
            self._inner.prepare(tx, rest)
        self._prepared[tx] = (parked, bool(rest))

    def commit(self, tx: int) -> None:
        parked, inner = self._prepared.pop(tx, ((), True))
        if inner:
            self._inner.commit(tx)
        if parked:
            self._drop(parked)

    def abort(self, tx: int) -> None:
        _, inner = self._prepared.pop(tx, ((), True))
        if inner:
            self._inner.abort(tx)

    def is_mapped(self, page: int) -> bool:
        return page in self._parked or bool(self._inner.is_mapped(page))

    def mapped_pages(self) -> list[int]:
        return sorted(set(self._inner.mapped_pages()).union(self._parked))

    @property
    def num_mapped(self) -> int:
        return int(self._inner.num_mapped) + len(self._parked)

    def close(self) -> None:
        self._release_copy()
        self._inner.close()
