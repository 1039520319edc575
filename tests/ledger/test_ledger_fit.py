"""What fits under a pool's ceiling (``elastic_kv.ledger.fit``): the blocks requests can hold under a limit
or a budget, the bytes a request needs, and how the ledger follows ``kvctl`` and publishes both."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic_kv import registry
from elastic_kv.config import ElasticConfig
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.fit import blocks_within, bytes_for_blocks, page_cost
from hypothesis import given, settings
from hypothesis import strategies as st

from .ledger_helpers import SLOT, make_pool, small_geometry, straddling_geometry

CFG = ElasticConfig(
    page_size=SLOT, premap=False, reserve_min_pages=0, reserve_max_pages=4, publish_interval_s=0
)
GEOMETRIES = {"exact": small_geometry(), "shared-slots": straddling_geometry()}


@pytest.mark.parametrize("kind", GEOMETRIES)
@settings(max_examples=200, deadline=None)
@given(blocks=st.integers(0, 80), nbytes=st.integers(0, 80 * SLOT), null=st.booleans())
def test_the_two_directions_agree(kind: str, blocks: int, nbytes: int, null: bool) -> None:
    geo = GEOMETRIES[kind]
    if blocks > geo.num_blocks - null:
        return
    fits = blocks <= blocks_within(geo, nbytes, null_block=null)
    assert fits == (bytes_for_blocks(geo, blocks, null_block=null) <= nbytes)


def test_whole_pages_and_the_null_block_are_counted() -> None:
    geo = small_geometry()  # 4 blocks a page, no shared slot
    page = geo.page_bytes
    assert page_cost(geo) == page
    assert blocks_within(geo, 3 * page - 1, null_block=True) == 2 * 4 - 1
    assert blocks_within(geo, 3 * page, null_block=True) == 3 * 4 - 1
    assert blocks_within(geo, 10**12, null_block=True) == geo.num_blocks - 1
    assert bytes_for_blocks(geo, 0, null_block=True) == 0
    assert bytes_for_blocks(geo, 3, null_block=True) == page  # beside the null block on its page
    assert bytes_for_blocks(geo, 4, null_block=True) == 2 * page
    assert bytes_for_blocks(geo, 4, null_block=False) == page


def test_shared_slots_never_count_less_room_than_there_is() -> None:
    """Where neighbouring pages share slots, a run of k pages costs at least its blocks' own bytes: the
    room counted is never below what the data plane would really back for those bytes."""
    geo = straddling_geometry()
    assert geo.shares_slots and page_cost(geo) < geo.page_bytes
    for pages in range(1, geo.num_pages + 1):
        real = geo.exclusive_bytes(range(pages), lambda _p: False)
        assert blocks_within(geo, real, null_block=False) >= pages * geo.blocks_per_page


@contextlib.contextmanager
def _ledger(tmp_path: Path, name: str, config: ElasticConfig = CFG) -> Iterator[Ledger]:
    """A ledger over the small geometry whose pool has a record named ``name`` on device ``gpu0``."""
    record = registry.PoolRecord.create(
        name, device="gpu0", engine="test", model="tiny", limit_bytes=0, registry_dir=tmp_path
    )
    pool = make_pool(config=config, record=record, name=record.name)
    try:
        yield pool.ledger
    finally:
        pool.close()
        record.close()


def test_the_ledger_follows_its_limit_and_its_devices_budget(tmp_path: Path) -> None:
    view, page = registry.Registry(tmp_path), small_geometry().page_bytes
    with _ledger(tmp_path, "fit") as led:
        assert led.max_request_blocks == 63  # every block but the null block
        view.set_limit("fit", 5 * page)
        led.maintain()
        assert led.max_request_blocks == 5 * 4 - 1
        view.set_budget("gpu0", 3 * page + page // 2)  # the tighter bound now; whole pages count
        led.maintain()
        assert led.max_request_blocks == 3 * 4 - 1
        view.set_limit("fit", 0)
        view.set_budget("gpu0", 0)
        led.maintain()
        assert led.max_request_blocks == 63
        led.resize(2 * page)  # a limit given to the ledger directly
        assert led.max_request_blocks == 2 * 4 - 1


def test_what_the_engine_reports_is_published(tmp_path: Path) -> None:
    view, page = registry.Registry(tmp_path), small_geometry().page_bytes
    with _ledger(tmp_path, "said") as led:
        led.note_largest_request(9)  # 9 blocks beside the null block: 3 pages of 4
        led.note_failed(2)
        led.publish()
        snap = view.pool("said").snapshot
        assert snap is not None
        assert (snap.largest_request_bytes, snap.failed_requests) == (3 * page, 2)
        led.note_largest_request(0)  # no request left
        led.publish()
        snap = view.pool("said").snapshot
        assert snap is not None and snap.largest_request_bytes == 0 and snap.failed_requests == 2


def test_an_admission_check_sees_a_neighbour_charge_at_once(tmp_path: Path) -> None:
    """``available_size`` is a hint read from the headroom ``maintain`` last cached (its TTL is long against
    another pool's charge); ``refresh_room`` re-reads it, so an engine that admits right after sees the
    budget a neighbour took, whatever the age of the last reading."""
    view, page = registry.Registry(tmp_path), small_geometry().page_bytes
    slow = dataclasses.replace(CFG, free_memory_ttl_s=3600.0)
    neighbour = registry.PoolRecord.create(
        "neighbour", device="gpu0", engine="test", model="tiny", limit_bytes=0, registry_dir=tmp_path
    )
    with _ledger(tmp_path, "admit", slow) as led, contextlib.closing(neighbour):
        view.set_budget("gpu0", 8 * page)
        led.maintain()  # the budget is seen (a limit change forces a reading)
        assert led.available_size() >= 4 * 4
        assert neighbour.try_charge(8 * page - view.pool("admit").charged_bytes)
        assert led.available_size() >= 4 * 4  # the cached reading: the neighbour's charge is not seen
        led.refresh_room()
        assert led.available_size() == 3  # the null block's page, backed already: nothing more to charge
        assert led.alloc(4) is None
