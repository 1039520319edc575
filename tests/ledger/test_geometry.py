"""BlockGeometry: pure arithmetic, checked against brute force (every byte, every slot)."""

from __future__ import annotations

import pytest
from elastic_kv.errors import ConfigError
from elastic_kv.geometry import BlockFamily, BlockGeometry, strided_families
from hypothesis import given, reject, settings
from hypothesis import strategies as st

KIB = 1024


def assert_blocks_inside_pages(
    geo: BlockGeometry, block_bytes: dict[int, set[tuple[int, int]]] | None = None
) -> None:
    """Every byte of every block lies inside the byte ranges of its page, and inside its space."""
    for block in range(geo.num_blocks):
        page = geo.page_of(block)
        assert block in geo.blocks_of(page)
        ranges = geo.page_ranges(page)
        for space, start, end in geo.block_ranges(block):
            assert end <= geo.space_sizes[space]
            assert any(s == space and lo <= start and end <= hi for s, lo, hi in ranges), (block, page)
        if block_bytes is not None:
            # the engine's own view of the block: each (space, byte) must be in a page range
            for space, byte in block_bytes[block]:
                assert any(s == space and lo <= byte < hi for s, lo, hi in ranges), (block, space, byte)


def brute_slots(geo: BlockGeometry, pages: set[int]) -> set[tuple[int, int]]:
    size = geo.page_size
    out: set[tuple[int, int]] = set()
    for p in pages:
        for space, start, end in geo.page_ranges(p):
            out.update((space, s) for s in range(start // size, (end - 1) // size + 1))
    return out


def test_layer_outer_aligned_pages_do_not_share_slots() -> None:
    # 4 layers x 64 blocks of 16 KiB, layer-outer: 4 blocks per 64 KiB slot, layers slot-aligned.
    geo = BlockGeometry.from_layer_strides(
        4 * 64 * 16 * KIB, 64, 4, 64 * 16 * KIB, 16 * KIB, 16 * KIB, 64 * KIB
    )
    assert geo.blocks_per_page == 4 and geo.num_pages == 16
    assert not geo.shares_slots
    assert geo.page_bytes == 4 * 64 * KIB
    assert geo.extent_tuples() == [(0, layer * 64 * 16 * KIB, 64 * KIB, 64 * KIB) for layer in range(4)]
    assert geo.exclusive_bytes([0, 1, 1], lambda p: False) == 2 * geo.page_bytes
    assert_blocks_inside_pages(geo)


def test_block_outer_layers_merge_into_one_extent() -> None:
    # block-outer: a block is 4 layers x 8 KiB contiguous (block stride 32 KiB).
    geo = BlockGeometry.from_layer_strides(100 * 32 * KIB, 100, 4, 8 * KIB, 32 * KIB, 8 * KIB, 64 * KIB)
    assert geo.families == (BlockFamily(0, 0, 32 * KIB, 32 * KIB),)
    assert geo.blocks_per_page == 2 and len(geo.extents) == 1
    assert geo.num_pages == 50
    assert_blocks_inside_pages(geo)


def test_non_power_of_two_block_gets_straddle_free_compound_page() -> None:
    # 48 KiB blocks in 64 KiB slots: 4 blocks = 3 slots, no block straddles a page.
    geo = BlockGeometry.from_layer_strides(40 * 48 * KIB, 40, 1, 40 * 48 * KIB, 48 * KIB, 48 * KIB, 64 * KIB)
    assert geo.blocks_per_page == 4
    assert geo.extents[0].step == 3 * 64 * KIB
    assert not geo.shares_slots
    assert_blocks_inside_pages(geo)


def test_straddling_blocks_stay_usable_when_compound_page_too_big() -> None:
    # 48 KiB blocks, but pages may span one slot only: blocks straddle, slots are shared, no block is lost.
    geo = BlockGeometry.from_layer_strides(
        40 * 48 * KIB, 40, 1, 40 * 48 * KIB, 48 * KIB, 48 * KIB, 64 * KIB, max_page_slots=1
    )
    assert geo.blocks_per_page == 1
    assert geo.num_pages == 40
    assert geo.shares_slots
    assert sum(len(geo.blocks_of(p)) for p in range(geo.num_pages)) == 40
    assert_blocks_inside_pages(geo)


def test_block_larger_than_page_is_config_error_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="ELASTIC_KV_PAGE_SIZE to at least 196608"):
        BlockGeometry.from_layer_strides(
            10 * 160 * KIB, 10, 1, 10 * 160 * KIB, 160 * KIB, 160 * KIB, 64 * KIB, max_page_slots=2
        )


def test_layout_that_does_not_fit_its_buffer_is_rejected() -> None:
    with pytest.raises(ValueError, match="past the end of its buffer"):
        BlockGeometry.from_layer_strides(10 * 16 * KIB - 1, 10, 1, 0, 16 * KIB, 16 * KIB, 64 * KIB)
    with pytest.raises(ValueError, match="blocks may not overlap"):
        BlockGeometry([1 << 20], [BlockFamily(0, 0, 4 * KIB, 8 * KIB)], 10, 64 * KIB)
    with pytest.raises(ValueError, match="names space 1"):
        BlockGeometry([1 << 20], [BlockFamily(1, 0, 4 * KIB, 4 * KIB)], 10, 64 * KIB)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockGeometry([1 << 20], [BlockFamily(0, 0, 4 * KIB, 4 * KIB)], 0, 64 * KIB)


def test_last_partial_page_holds_the_remaining_blocks() -> None:
    geo = BlockGeometry.from_layer_strides(10 * 16 * KIB, 10, 1, 0, 16 * KIB, 16 * KIB, 64 * KIB)
    assert geo.num_pages == 3
    assert list(geo.blocks_of(2)) == [8, 9]
    assert geo.space_sizes == (3 * 64 * KIB,)  # the space covers the whole last page


def test_strided_families_splits_heads_when_head_is_outside_block() -> None:
    # [L=2, H=3, B, N*C=1 KiB] with the block axis inside heads (vLLM LHBNC): one family per layer and head.
    fams = strided_families(0, 0, 1 * KIB, [(2, 3 * 10 * KIB), (3, 10 * KIB), (KIB, 1)])
    assert [f.base for f in fams] == [h * 10 * KIB + layer * 30 * KIB for layer in range(2) for h in range(3)]
    assert all(f.nbytes == KIB and f.stride == KIB for f in fams)
    with pytest.raises(ValueError, match="overlaps"):
        strided_families(0, 0, KIB, [(4, 100), (KIB, 1)])


def test_sglang_halves_share_slot_when_v_offset_is_unaligned() -> None:
    # SGLang MHA, page size 1: per layer (2, rows, row) with rows*row not a multiple of the slot.
    rows, row = 1000, 512
    geo = BlockGeometry.from_token_buffers(
        [2 * rows * row] * 3, [[0, rows * row]] * 3, row, 1, rows, 64 * KIB
    )
    assert geo.blocks_per_page == 128
    assert geo.shares_slots  # the last K page and the first V page meet inside one slot
    assert_blocks_inside_pages(geo)
    last_k = geo.num_pages - 1
    assert geo.exclusive_bytes([0], lambda p: p == last_k) < geo.exclusive_bytes([0], lambda p: False)


@st.composite
def geometries(draw: st.DrawFn) -> BlockGeometry:
    page_size = draw(st.sampled_from([4 * KIB, 8 * KIB, 64 * KIB]))
    num_blocks = draw(st.integers(1, 60))
    nspaces = draw(st.integers(1, 3))
    families = []
    sizes = [0] * nspaces
    for _ in range(draw(st.integers(1, 4))):
        space = draw(st.integers(0, nspaces - 1))
        stride = draw(st.integers(1, 24)) * 512
        nbytes = draw(st.integers(1, stride // 512)) * 512
        base = sizes[space] + draw(st.integers(0, 8)) * 512
        families.append(BlockFamily(space, base, stride, nbytes))
        sizes[space] = base + (num_blocks - 1) * stride + nbytes
    slots = draw(st.integers(1, 4))
    bpp = draw(st.none() | st.integers(1, 9))
    try:
        return BlockGeometry(
            sizes, families, num_blocks, page_size, max_page_slots=slots, blocks_per_page=bpp
        )
    except ConfigError:
        reject()


@settings(max_examples=300, deadline=None)
@given(geometries(), st.data())
def test_random_layouts_against_brute_force(geo: BlockGeometry, data: st.DataObject) -> None:
    assert_blocks_inside_pages(geo)
    # pages_touching agrees with a brute-force scan of every page
    size = geo.page_size
    for space, total in enumerate(geo.space_sizes):
        for slot in range(total // size):
            brute = [p for p in range(geo.num_pages) if (space, slot) in brute_slots(geo, {p})]
            assert geo.pages_touching(space, slot) == brute
    # shares_slots is never a false negative
    owners: dict[tuple[int, int], set[int]] = {}
    for p in range(geo.num_pages):
        for key in brute_slots(geo, {p}):
            owners.setdefault(key, set()).add(p)
    if any(len(ps) > 1 for ps in owners.values()):
        assert geo.shares_slots
    # page_bytes bounds every single page
    assert all(len(brute_slots(geo, {p})) * size <= geo.page_bytes for p in range(geo.num_pages))
    # exclusive_bytes == what slot reference counting backs or releases
    mapped = set(data.draw(st.sets(st.integers(0, geo.num_pages - 1))))
    batch = set(data.draw(st.sets(st.integers(0, geo.num_pages - 1), min_size=1)))
    new = batch - mapped
    expect_map = (len(brute_slots(geo, mapped | new)) - len(brute_slots(geo, mapped))) * size
    assert geo.exclusive_bytes(new, mapped.__contains__) == expect_map
    gone = batch & mapped
    expect_unmap = (len(brute_slots(geo, mapped)) - len(brute_slots(geo, mapped - gone))) * size
    assert geo.exclusive_bytes(gone, mapped.__contains__) == expect_unmap
