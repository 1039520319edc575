"""Block geometry: which bytes of which spaces a KV block occupies, and how blocks group into pages.

One file over 400 lines on purpose: one value type and the layouts of every engine that build it, so
that a new layout is checked against the same rules as the others.

An engine lays its KV cache out its own way; elastic-kv never changes that layout (same kernels, same
strides). It only decides which parts are backed. This module turns an engine's layout into:

* the **spaces** to reserve (one per engine allocation: vLLM >= 0.29 has one buffer, SGLang one per layer);
* the **block families**: ``BlockFamily(space, base, stride, nbytes)`` says that block ``b`` owns bytes
  ``[base + b*stride, base + b*stride + nbytes)`` of ``space``. Every layout we serve is a list of them:
  vLLM layer-outer (one per layer), block-outer (one, all layers of a block being contiguous), head-split
  layouts (one per layer and head), SGLang K and V halves of each layer's allocation, MLA latents;
* the **logical page**: ``blocks_per_page`` consecutive blocks, backed and released together, and the
  **extents** ``(space, base, step, length)`` that give the data plane (``_vmm.SpaceGroup``) the bytes of
  page ``p`` in each space: ``[base + p*step, base + p*step + length)``.

Choosing ``blocks_per_page``: a page must hold whole blocks and should not share a slot (``page_size``
bytes of a space, the unit a physical handle backs) with its neighbour. The smallest block count whose
bytes are a whole number of slots in every family gives straddle-free pages; it is used when that page
spans at most ``max_page_slots`` slots. Otherwise pages hold as many blocks as fit in one slot and
blocks straddle slot boundaries: the data plane reference-counts a slot that two pages touch, so no
capacity is lost either way. Families whose base is not slot-aligned (a layer that starts mid-slot) also
share slots; :attr:`BlockGeometry.shares_slots` says whether any slot can be shared, and
:meth:`BlockGeometry.exclusive_bytes` gives the exact physical bytes that mapping or unmapping a set of
pages changes, so the ledger can charge exactly what the data plane backs.

All arithmetic is on Python ints; nothing here touches memory.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from elastic_kv.errors import ConfigError

__all__ = ["BlockFamily", "BlockGeometry", "Extent", "strided_families"]


@dataclass(frozen=True, slots=True)
class BlockFamily:
    """Block ``b`` owns bytes ``[base + b*stride, base + b*stride + nbytes)`` of space ``space``."""

    space: int
    base: int
    stride: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Extent:
    """Page ``p`` owns bytes ``[base + p*step, base + p*step + length)`` of space ``space`` (the data-plane
    contract of ``_vmm.SpaceGroup``)."""

    space: int
    base: int
    step: int
    length: int

    def as_tuple(self) -> tuple[int, int, int, int]:
        """``(space, base, step, length)``, the form ``_vmm.SpaceGroup`` takes."""
        return (self.space, self.base, self.step, self.length)


def strided_families(
    space: int, offset: int, block_stride: int, axes: Sequence[tuple[int, int]]
) -> list[BlockFamily]:
    """Families of one strided buffer: block ``b``'s bytes are ``offset + b*block_stride + sum(i_k*stride_k)``
    over every index ``i_k < count_k`` of ``axes`` (``(count, byte stride)`` pairs, any order; the byte axis
    itself is one of them, with stride 1).

    The innermost axes that are dense (each stride equals the product of the inner counts) fuse into one
    contiguous run, as long as the run stays within ``block_stride`` (a block's run never reaches into the
    next block's; with a single block, a layer-outer buffer's layers are as dense as a layer's bytes and
    stay apart); every combination of the remaining axes gives one family. vLLM's ``[L, B, H, N, C]``
    layouts reduce to one family per layer (``LBHNC``), per layer and head (``LHBNC``) or one in all
    (``BHLNC``). Raises ``ValueError`` when two axes overlap (not a valid layout).
    """
    live = sorted(((count, stride) for count, stride in axes if count > 1), key=lambda a: a[1])
    run = 1
    inner = 0
    while inner < len(live) and live[inner][1] == run and run * live[inner][0] <= block_stride:
        run *= live[inner][0]
        inner += 1
    outer = live[inner:]
    for count, stride in outer:
        if stride < run:
            raise ValueError(
                f"axis (count={count}, stride={stride}) overlaps a contiguous run of {run} bytes"
            )
    bases = [offset]
    for count, stride in outer:
        bases = [b + i * stride for b in bases for i in range(count)]
    return [BlockFamily(space, b, block_stride, run) for b in sorted(bases)]


def _merge_families(families: Iterable[BlockFamily]) -> list[BlockFamily]:
    """Fuse families of one space and stride whose runs touch or overlap (e.g. the layers of a block-outer
    buffer, or aliasing cache groups) so that a page needs as few extents as possible."""
    merged: list[BlockFamily] = []
    for fam in sorted(families, key=lambda f: (f.space, f.stride, f.base)):
        last = merged[-1] if merged else None
        if (
            last
            and last.space == fam.space
            and last.stride == fam.stride
            and fam.base <= last.base + last.nbytes
        ):
            end = max(last.base + last.nbytes, fam.base + fam.nbytes)
            merged[-1] = BlockFamily(last.space, last.base, last.stride, end - last.base)
        else:
            merged.append(fam)
    return merged


class BlockGeometry:
    """Maps engine blocks to logical pages and logical pages to byte ranges of the spaces of one pool.

    Build it with the constructor (generic families) or one of the classmethods for an engine layout.
    ``num_blocks`` counts every block id, including the engine's null/padding block. Contract: for every
    block ``b``, every byte of ``block_ranges(b)`` lies inside ``page_ranges(page_of(b))``.
    """

    def __init__(
        self,
        buffer_sizes: Sequence[int],
        families: Sequence[BlockFamily],
        num_blocks: int,
        page_size: int,
        *,
        max_page_slots: int = 8,
        blocks_per_page: int | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if page_size <= 0:
            raise ValueError(f"page_size={page_size} must be > 0")
        if not families:
            raise ValueError("a geometry needs at least one block family")
        for fam in families:
            if not 0 <= fam.space < len(buffer_sizes):
                raise ValueError(f"{fam} names space {fam.space}; there are {len(buffer_sizes)}")
            if fam.base < 0 or fam.stride <= 0 or fam.nbytes <= 0 or fam.nbytes > fam.stride:
                raise ValueError(f"{fam}: need base >= 0 and 0 < nbytes <= stride (blocks may not overlap)")
            end = fam.base + (num_blocks - 1) * fam.stride + fam.nbytes
            if end > buffer_sizes[fam.space]:
                raise ValueError(
                    f"{fam}: block {num_blocks - 1} ends at byte {end}, past the end of its buffer "
                    f"({buffer_sizes[fam.space]} bytes)"
                )
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.families: tuple[BlockFamily, ...] = tuple(_merge_families(families))
        self.block_bytes = sum(f.nbytes for f in self.families)
        if blocks_per_page is not None and blocks_per_page < 1:
            raise ValueError(f"blocks_per_page={blocks_per_page} must be >= 1")
        self.blocks_per_page = blocks_per_page or self._choose_blocks_per_page(max_page_slots)
        bpp = self.blocks_per_page
        self.num_pages = -(-num_blocks // bpp)
        self.extents: tuple[Extent, ...] = tuple(
            Extent(f.space, f.base, bpp * f.stride, (bpp - 1) * f.stride + f.nbytes) for f in self.families
        )
        # A space must cover its engine buffer and every byte any page may touch (the last page of a family
        # may run past its blocks when num_blocks is not a multiple of blocks_per_page).
        sizes = list(buffer_sizes)
        for ext in self.extents:
            sizes[ext.space] = max(sizes[ext.space], ext.base + (self.num_pages - 1) * ext.step + ext.length)
        self.space_sizes: tuple[int, ...] = tuple(-(-s // page_size) * page_size for s in sizes)
        self._index_spaces()
        self.shares_slots = self._compute_shares_slots()
        self.page_bytes = self._compute_page_bytes()

    # -- construction helpers -------------------------------------------------------------------------

    def _choose_blocks_per_page(self, max_page_slots: int) -> int:
        size = self.page_size
        largest = max(self.families, key=lambda f: f.stride)
        if largest.stride > size * max_page_slots:
            need = -(-largest.stride // size) * size
            raise ConfigError(
                f"a block needs {largest.stride} bytes in space {largest.space}, more than a logical "
                f"page of at most {max_page_slots} x {size} bytes: set ELASTIC_KV_PAGE_SIZE to at least "
                f"{need} bytes (a multiple of the backend granularity) or ELASTIC_KV_MAX_PAGE_SLOTS to at "
                f"least {-(-largest.stride // size)}, or lower the engine's block size"
            )
        # Smallest block count whose bytes are whole slots in every family: straddle-free pages.
        aligned = 1
        for fam in self.families:
            aligned = math.lcm(aligned, size // math.gcd(fam.stride, size))
        if aligned * largest.stride <= size * max_page_slots:
            # The smallest straddle-free page: more blocks per page would only make elasticity coarser.
            return aligned
        # Straddling pages: as many blocks as fit in one slot; shared slots are reference-counted.
        return max(1, size // largest.stride)

    def _index_spaces(self) -> None:
        """Per space, extents sorted by the start of their span, with the running maximum span end, so that
        the extents that can touch a slot are found by bisection."""
        self._space_extents: list[list[Extent]] = [[] for _ in self.space_sizes]
        for ext in sorted(self.extents, key=lambda e: e.base):
            self._space_extents[ext.space].append(ext)
        self._span_starts = [[e.base for e in exts] for exts in self._space_extents]
        self._span_max_end: list[list[int]] = []
        for exts in self._space_extents:
            running, ends = 0, []
            for e in exts:
                running = max(running, self._span_end(e))
                ends.append(running)
            self._span_max_end.append(ends)
        # Slots covered by the spans of two or more extents of a space (layer boundaries that are not
        # slot-aligned, aliasing cache groups), as sorted inclusive (first, last) runs per space: only there,
        # and at the first and last slot of a page's range, can a page share a slot (see exclusive_bytes).
        self._contested: list[list[tuple[int, int]]] = []
        size = self.page_size
        for exts in self._space_extents:
            edges: list[tuple[int, int]] = []
            for e in exts:
                edges += [(e.base // size, 1), ((self._span_end(e) - 1) // size + 1, -1)]
            runs: list[tuple[int, int]] = []
            depth, start = 0, 0
            for slot, step in sorted(edges):
                if depth >= 2 and slot > start:
                    if runs and runs[-1][1] >= start - 1:
                        runs[-1] = (runs[-1][0], slot - 1)
                    else:
                        runs.append((start, slot - 1))
                depth += step
                start = slot
            self._contested.append(runs)
        self._touching: dict[tuple[int, int], tuple[int, ...]] = {}

    def _span_end(self, ext: Extent) -> int:
        return ext.base + (self.num_pages - 1) * ext.step + ext.length

    def _compute_shares_slots(self) -> bool:
        """Whether one slot may be touched twice: by two pages, or by two extents of one page (conservative:
        True may be a false alarm, False is exact and makes every page cost exactly ``page_bytes``)."""
        size = self.page_size
        if self.num_pages > 1:
            for ext in self.extents:
                if ext.base % size or ext.step % size or ext.length > ext.step:
                    return True
        for exts in self._space_extents:
            last_slot = -1
            for e in exts:
                first = e.base // size
                if first <= last_slot:
                    return True
                last_slot = max(last_slot, (self._span_end(e) - 1) // size)
        return False

    def _compute_page_bytes(self) -> int:
        """Most physical bytes one page can need alone (exact when no slot is shared)."""
        size, total = self.page_size, 0
        for ext in self.extents:
            g = math.gcd(ext.step, size)
            worst_offset = size - g + ext.base % g if self.num_pages > 1 else ext.base % size
            total += ((worst_offset + ext.length - 1) // size + 1) * size
        return total

    # -- engine layouts -------------------------------------------------------------------------------

    @classmethod
    def from_strided(
        cls,
        size: int,
        num_blocks: int,
        block_stride: int,
        axes: Sequence[tuple[int, int]],
        page_size: int,
        *,
        offset: int = 0,
        max_page_slots: int = 8,
    ) -> BlockGeometry:
        """One buffer of ``size`` bytes where block ``b`` is ``offset + b*block_stride + sum(i_k*stride_k)``
        over ``axes`` (see :func:`strided_families`). vLLM >= 0.29 passes, per ``KVCacheTensor``, its
        ``[L, H, N, C]`` counts and byte strides (``compute_layout_strides``); for several cache groups
        overlaying one buffer build the families with :func:`strided_families` and use the constructor."""
        return cls(
            [size],
            strided_families(0, offset, block_stride, axes),
            num_blocks,
            page_size,
            max_page_slots=max_page_slots,
        )

    @classmethod
    def from_layer_strides(
        cls,
        size: int,
        num_blocks: int,
        num_layers: int,
        layer_stride: int,
        block_stride: int,
        layer_block_bytes: int,
        page_size: int,
        *,
        offset: int = 0,
        max_page_slots: int = 8,
    ) -> BlockGeometry:
        """vLLM's ``KVCacheTensor`` in the common case: layer ``l`` of block ``b`` is the contiguous run
        ``[offset + l*layer_stride + b*block_stride, ... + layer_block_bytes)``. Layer-outer
        (``layer_stride = num_blocks * page``) and block-outer (``layer_stride = page``) layouts both fit."""
        return cls.from_strided(
            size,
            num_blocks,
            block_stride,
            [(num_layers, layer_stride), (layer_block_bytes, 1)],
            page_size,
            offset=offset,
            max_page_slots=max_page_slots,
        )

    @classmethod
    def from_token_buffers(
        cls,
        buffer_sizes: Sequence[int],
        row_offsets: Sequence[Sequence[int]],
        row_bytes: int,
        rows_per_block: int,
        num_blocks: int,
        page_size: int,
        *,
        max_page_slots: int = 8,
    ) -> BlockGeometry:
        """SGLang-style pools: one buffer per layer (or per layer and K/V), each holding one or more arrays of
        rows (``row_offsets[i]`` = the byte offsets where buffer ``i``'s arrays start; K and V halves of one
        allocation are two offsets, an MLA latent or a packed K/V buffer one). Block ``b`` owns rows
        ``[b*rows_per_block, (b+1)*rows_per_block)`` of every array (an SGLang page; ``rows_per_block`` is 1
        for NHD rows at page size 1, the page size for NHD rows, 1 when a row already is a page)."""
        if len(row_offsets) != len(buffer_sizes):
            raise ValueError("row_offsets needs one entry per buffer")
        block = rows_per_block * row_bytes
        families = [
            BlockFamily(space, off, block, block) for space, offs in enumerate(row_offsets) for off in offs
        ]
        return cls(buffer_sizes, families, num_blocks, page_size, max_page_slots=max_page_slots)

    # -- queries ----------------------------------------------------------------------------------------

    def page_of(self, block: int) -> int:
        """The logical page that holds ``block``."""
        return block // self.blocks_per_page

    def blocks_of(self, page: int) -> range:
        """The block ids page ``page`` holds (the last page may hold fewer than ``blocks_per_page``)."""
        start = page * self.blocks_per_page
        return range(start, min(start + self.blocks_per_page, self.num_blocks))

    def block_ranges(self, block: int) -> list[tuple[int, int, int]]:
        """Every byte range ``(space, start, end)`` of ``block``, one per family."""
        return [
            (f.space, f.base + block * f.stride, f.base + block * f.stride + f.nbytes) for f in self.families
        ]

    def page_ranges(self, page: int) -> list[tuple[int, int, int]]:
        """Every byte range ``(space, start, end)`` that backing page ``page`` backs, one per extent."""
        return [(e.space, e.base + page * e.step, e.base + page * e.step + e.length) for e in self.extents]

    def page_slots(self, page: int) -> list[tuple[int, int, int]]:
        """Slots page ``page`` touches: ``(space, first_slot, last_slot)`` (inclusive), one per extent."""
        size = self.page_size
        return [(s, start // size, (end - 1) // size) for s, start, end in self.page_ranges(page)]

    def extent_tuples(self) -> list[tuple[int, int, int, int]]:
        """The extents in the form ``_vmm.SpaceGroup`` takes."""
        return [e.as_tuple() for e in self.extents]

    def pages_touching(self, space: int, slot: int) -> list[int]:
        """Every page whose byte ranges touch slot ``slot`` of space ``space`` (ascending, no duplicates)."""
        size = self.page_size
        lo_byte, hi_byte = slot * size, (slot + 1) * size
        exts, starts, max_end = (
            self._space_extents[space],
            self._span_starts[space],
            self._span_max_end[space],
        )
        pages: set[int] = set()
        i = bisect.bisect_left(starts, hi_byte) - 1
        while i >= 0 and max_end[i] > lo_byte:
            e = exts[i]
            # page p touches the slot iff base + p*step < hi_byte and base + p*step + length > lo_byte
            p_lo = max(0, (lo_byte - e.base - e.length) // e.step + 1)
            p_hi = min(self.num_pages - 1, -(-(hi_byte - e.base) // e.step) - 1)
            pages.update(range(p_lo, p_hi + 1))
            i -= 1
        return sorted(pages)

    def exclusive_bytes(self, pages: Iterable[int], is_mapped: Callable[[int], bool]) -> int:
        """Physical bytes of the slots that ``pages`` touch and that no *other* page with
        ``is_mapped(page)`` touches: what mapping ``pages`` adds, or what unmapping them releases, given the
        pages mapped now. Exact (it is what the data plane's slot reference counts do).

        O(1) per page when no slot is shared. Otherwise only the slots that can be shared are looked up:
        the first and last slot of each of a page's ranges and slots where extents' spans overlap (a slot
        strictly inside a page's range, of an extent whose pages do not overlap, belongs to that page
        alone); lookups are cached, so a page costs O(extents)."""
        batch = set(pages)
        if not self.shares_slots:
            return len(batch) * self.page_bytes
        size = self.page_size
        check: set[tuple[int, int]] = set()
        alone = 0  # slots only this page can touch
        for page in batch:
            for ext in self.extents:
                start = ext.base + page * ext.step
                first, last = start // size, (start + ext.length - 1) // size
                if ext.length > ext.step or last - first < 2:
                    check.update((ext.space, s) for s in range(first, last + 1))
                    continue
                check.add((ext.space, first))
                check.add((ext.space, last))
                inner = last - first - 1
                for lo, hi in self._contested[ext.space]:
                    if hi <= first or lo >= last:
                        continue
                    shared = range(max(lo, first + 1), min(hi, last - 1) + 1)
                    check.update((ext.space, s) for s in shared)
                    inner -= len(shared)
                alone += inner
        free = alone
        for key in check:
            touching = self._touching.get(key)
            if touching is None:
                touching = self._touching[key] = tuple(self.pages_touching(*key))
            if not any(p not in batch and is_mapped(p) for p in touching):
                free += 1
        return free * size

    def describe(self) -> str:
        """One line for logs: blocks, pages, page footprint and whether slots are shared."""
        return (
            f"{self.num_blocks} blocks of {self.block_bytes} B in {len(self.space_sizes)} space(s), "
            f"{self.blocks_per_page} blocks/page, {self.num_pages} pages of <= {self.page_bytes} B "
            f"({len(self.extents)} extent(s), slot {self.page_size} B, shared slots: {self.shares_slots})"
        )

    def __repr__(self) -> str:
        return f"BlockGeometry({self.describe()})"
