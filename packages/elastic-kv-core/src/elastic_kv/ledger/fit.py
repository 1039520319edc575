"""What fits under a pool's ceiling: the blocks requests can hold, and the bytes a request needs.

A pool's **ceiling** is the most it may ever hold while ``kvctl``'s settings stay as they are: the tightest
of its limit and its devices' budgets (:meth:`.physical.PhysicalAccount.ceiling`). Other pools'
charges and the driver's free memory change on their own, so they only make a request *wait*; a request
that needs more than the ceiling can never run until someone raises it.

Both directions are counted in whole pages, the null block's page first (it is backed for the pool's life
and holds ``blocks_per_page - 1`` blocks beside the null block):

* :func:`blocks_within` -- the most blocks the engine's requests can hold together when the pool holds at
  most ``nbytes``;
* :func:`bytes_for_blocks` -- the least the pool must hold for ``blocks`` blocks beside its null block.

They agree: ``blocks <= blocks_within(n)`` exactly when ``bytes_for_blocks(blocks) <= n``. A page costs its
``page_bytes`` when no slot is shared (exact). Where neighbouring pages share slots
(``BlockGeometry.shares_slots``) a run of pages costs less than ``page_bytes`` each, but never less than its
blocks' own bytes; that floor is what is counted then, so :func:`blocks_within` never reports less room
than there is and an engine never ends a request that could have fit.
"""

from __future__ import annotations

from elastic_kv.geometry import BlockGeometry

__all__ = ["blocks_within", "bytes_for_blocks", "page_cost"]


def page_cost(geo: BlockGeometry) -> int:
    """Bytes one page of a run of pages costs at least: ``page_bytes``, or where neighbouring pages share
    slots, its blocks' own bytes."""
    return geo.blocks_per_page * geo.block_bytes if geo.shares_slots else geo.page_bytes


def blocks_within(geo: BlockGeometry, nbytes: int, *, null_block: bool) -> int:
    """The most blocks requests can hold when the pool holds at most ``nbytes`` (``null_block``: one block
    of the first page is the pool's null block, held for its life)."""
    cost = page_cost(geo)
    pages = min(geo.num_pages, max(0, nbytes) // cost) if cost else geo.num_pages
    return max(0, min(geo.num_blocks, pages * geo.blocks_per_page) - null_block)


def bytes_for_blocks(geo: BlockGeometry, blocks: int, *, null_block: bool) -> int:
    """The least the pool must hold for requests to hold ``blocks`` blocks (0 for none); with ``null_block``
    the null block's page is counted too."""
    if blocks <= 0:
        return 0
    bpp = geo.blocks_per_page
    return -(-(blocks + null_block) // bpp) * page_cost(geo)
