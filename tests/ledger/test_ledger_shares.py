"""One device identity (``elastic_kv.device``) and pools whose ranks back each page on several devices
(``elastic_kv.registry.create_shares``): every device's budget is charged for the ranks on it, atomically.

The ranks here are simulated by the charge only (one host data plane backs the ledger's pages); what the
ranks of a real TP=2 vLLM engine charge is checked in ``tests/vllm/test_vllm_elastic_tp.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic_kv.config import ElasticConfig
from elastic_kv.device import (
    HOST_DEVICE,
    default_min_free_bytes,
    device_free_bytes,
    device_key,
    device_total_bytes,
)
from elastic_kv.registry import DeviceShare, Registry, create_shares

from .ledger_helpers import SLOT, Pool, check_invariants, make_pool, small_geometry

PAGE = small_geometry().page_bytes
CFG = ElasticConfig(
    page_size=SLOT, premap=False, reserve_min_pages=0, reserve_max_pages=0, publish_interval_s=0
)


def test_host_device_has_one_fixed_key_and_its_memory_size() -> None:
    assert device_key("cpu") == device_key("cpu", 3) == HOST_DEVICE == "cpu"
    assert device_total_bytes("cpu") == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(ValueError, match="unknown device kind"):
        device_key("tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        device_key("cuda", -1)


def test_headroom_default_and_free_memory() -> None:
    assert default_min_free_bytes(80 << 30) == 5 << 29  # 2.5 GiB up to 125 GiB
    assert default_min_free_bytes(141 << 30) == (141 << 30) // 50  # 2% above
    free = device_free_bytes("cpu")
    assert free is not None and 0 < free <= device_total_bytes("cpu")
    assert device_free_bytes("cuda:0") is None  # a fallback name is no UUID: unknown, not a guess


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a CUDA driver is present")
def test_gpu_key_without_a_driver_falls_back_aloud(caplog: pytest.LogCaptureFixture) -> None:
    device_key.cache_clear()
    with caplog.at_level(logging.WARNING, logger="elastic_kv.device"):
        assert device_key("cuda", 1) == "cuda:1"
    assert "cannot read the UUID of cuda device 1" in caplog.text
    assert device_total_bytes("cuda", 1) == 0


@pytest.fixture
def tp3(tmp_path: Path) -> Iterator[tuple[Pool, list[DeviceShare], Registry]]:
    """A pool of three ranks: ranks 0 and 2 on device gpuA, rank 1 on gpuB."""
    view = Registry(tmp_path)
    shares = create_shares(
        "tp", ["gpuA", "gpuB", "gpuA"], engine="test", model="tiny", limit_bytes=0, registry_dir=tmp_path,
        device_total_bytes={"gpuA": 80 << 30, "gpuB": 40 << 30},
    )  # fmt: skip
    pool = make_pool(config=CFG, shares=shares, name=shares[0].record.name)
    yield pool, shares, view
    pool.close()
    for share in shares:
        assert share.record.charged_bytes == 0
        share.record.close()


def test_each_device_is_charged_for_its_ranks(tp3: tuple[Pool, list[DeviceShare], Registry]) -> None:
    pool, shares, view = tp3
    assert [(s.record.name, s.record.device, s.ranks) for s in shares] == [
        ("tp", "gpuA", 2),
        ("tp.r1", "gpuB", 1),
    ]
    assert {d.device: d.total_bytes for d in view.devices()} == {"gpuA": 80 << 30, "gpuB": 40 << 30}
    blocks = pool.ledger.alloc(3 + 2 * 4)  # the null block's page + 2 more pages
    assert blocks is not None
    check_invariants(pool)
    held = pool.group.mapped_bytes  # one rank's bytes
    assert held == 3 * PAGE
    charged = {d.device: d.charged_bytes for d in view.devices()}
    assert charged == {"gpuA": 2 * held, "gpuB": held}
    # kvctl shows each record's bytes on its own device.
    pool.ledger.maintain()
    listed = {p.name: p for p in view.pools()}
    assert listed["tp"].snapshot is not None and listed["tp"].snapshot.mapped_bytes == 2 * held
    assert listed["tp.r1"].snapshot is not None and listed["tp.r1"].snapshot.mapped_bytes == held
    pool.ledger.free(blocks)
    pool.ledger.maintain()
    assert {d.device: d.charged_bytes for d in view.devices()} == {"gpuA": 2 * PAGE, "gpuB": PAGE}


def test_a_refusal_on_one_device_charges_none(tp3: tuple[Pool, list[DeviceShare], Registry]) -> None:
    pool, _, view = tp3
    view.set_budget("gpuB", 2 * PAGE)  # gpuA has room; gpuB fits one more page only
    pool.ledger.maintain()
    assert pool.ledger.alloc(3 + 4) is not None
    before = {d.device: d.charged_bytes for d in view.devices()}
    assert before == {"gpuA": 4 * PAGE, "gpuB": 2 * PAGE}
    assert pool.ledger.alloc(4) is None  # gpuB's budget refuses: gpuA must not keep a charge
    assert {d.device: d.charged_bytes for d in view.devices()} == before
    check_invariants(pool)


def test_a_limit_on_any_record_binds_per_rank(tp3: tuple[Pool, list[DeviceShare], Registry]) -> None:
    pool, _, view = tp3
    view.set_limit("tp", 4 * PAGE)  # bytes on gpuA, where two ranks live: two pages per rank
    pool.ledger.maintain()
    assert pool.ledger.alloc(3 + 4) is not None  # two pages
    assert pool.ledger.alloc(4) is None
    view.set_limit("tp", 0)
    view.set_limit("tp.r1", 3 * PAGE)  # gpuB: one rank, three pages
    pool.ledger.maintain()
    assert pool.ledger.alloc(4) is not None
    assert pool.ledger.alloc(4) is None
    assert {d.device: d.charged_bytes for d in view.devices()} == {"gpuA": 6 * PAGE, "gpuB": 3 * PAGE}
