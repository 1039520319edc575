"""Helpers of the ledger tests: pools over the real host data plane, state fingerprints, a budget record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import LocalMapper

KIB = 1024
SLOT = 64 * KIB


def small_geometry(num_blocks: int = 64) -> BlockGeometry:
    """2 layers, layer-outer, 16 KiB blocks in 64 KiB slots: 4 blocks per page, no shared slots."""
    return BlockGeometry.from_layer_strides(
        2 * num_blocks * 16 * KIB, num_blocks, 2, num_blocks * 16 * KIB, 16 * KIB, 16 * KIB, SLOT
    )


def straddling_geometry(num_blocks: int = 40) -> BlockGeometry:
    """48 KiB blocks, one slot per page at most, and an unaligned second layer: slots shared by pages."""
    layer = num_blocks * 48 * KIB + 4 * KIB
    return BlockGeometry.from_layer_strides(
        2 * layer, num_blocks, 2, layer, 48 * KIB, 48 * KIB, SLOT, max_page_slots=1
    )


@dataclass
class Pool:
    """A ledger over a real SpaceGroup of the host backend (optionally behind a fault injector)."""

    ledger: Ledger
    mapper: LocalMapper
    backend: Any  # _vmm.HostBackend or _vmm.FaultInjectingBackend

    @property
    def group(self) -> _vmm.SpaceGroup:
        return self.mapper.group

    def close(self) -> None:
        self.ledger.close()
        self.mapper.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_pool(
    geometry: BlockGeometry | None = None,
    config: ElasticConfig | None = None,
    *,
    fault: bool = False,
    **kwargs: Any,
) -> Pool:
    geo = geometry or small_geometry()
    host = _vmm.HostBackend(granularity=geo.page_size)
    backend = _vmm.FaultInjectingBackend(host) if fault else host
    mapper = LocalMapper.for_geometry(backend, geo)
    cfg = config or ElasticConfig(page_size=geo.page_size, premap=False)
    return Pool(Ledger(geo, mapper, cfg, **kwargs), mapper, backend)


def fingerprint(pool: Pool) -> tuple[Any, ...]:
    """Everything a failed call must leave unchanged: the ledger's bookkeeping and the data plane's view."""
    led = pool.ledger
    book = led._book
    return (
        bytes(book.live),
        bytes(book.state),
        tuple(tuple(f) for f in book.page_free),
        tuple(book.page_bucket),
        book.mask,
        tuple(book.reserve),
        tuple(book.pending_epoch.items()),
        tuple(book.unmapped),
        book.free_backed,
        book.unmapped_blocks,
        led.used_blocks,
        led.charged_bytes,
        led.available_size(),
        tuple(pool.group.mapped_pages()),
        pool.group.mapped_bytes,
    )


def check_invariants(pool: Pool, issued: set[int] | None = None) -> None:
    """The ledger and the data plane agree; every live block's page is backed; counters add up."""
    led, group = pool.ledger, pool.group
    led.check_invariants()
    geo = led.geometry
    live = {b for b in range(geo.num_blocks) if led.is_live(b)}
    if issued is not None:
        expect = issued | ({led.null_block} if led.null_block is not None else set())
        assert live == expect, "the ledger's live blocks differ from what was issued"
    mapped = set(group.mapped_pages())
    for b in live:
        assert geo.page_of(b) in mapped, f"live block {b} on unbacked page {geo.page_of(b)}"
    inflight = {p for pages in led._book.inflight.values() for p in pages}
    ledger_backed = set(led.mapped_pages())
    assert ledger_backed <= mapped
    assert mapped - ledger_backed <= inflight, "data plane maps pages the ledger does not hold"
    if not inflight:
        assert led.charged_bytes == group.mapped_bytes, "charge != physical bytes backed"
    free_lists = [b for p in ledger_backed for b in led._book.page_free[p]]
    assert len(free_lists) == len(set(free_lists)) == led._book.free_backed + led._book.withheld_free
    assert not (set(free_lists) & live)
    assert led.used_blocks == len(live) - (led.null_block is not None)
    assert led.available_size() >= 0


@dataclass
class BudgetRecord:
    """A stand-in for ``elastic_kv.registry.PoolRecord`` (built on the ``limits`` branch) with the agreed
    contract: a limit and a device budget shared with other records, charge/uncharge, poll, publish."""

    limit_bytes: int = 0
    budget: list[int] = field(default_factory=lambda: [0, 0])  # [budget bytes (0 = none), charged by all]
    charged_bytes: int = 0
    published: list[Any] = field(default_factory=list)
    samples: list[tuple[str, float]] = field(default_factory=list)
    limit_changed: bool = False
    trim_requested: bool = False
    fail_next: Exception | None = None  # raised by the next try_charge (a broken record)

    @property
    def budget_bytes(self) -> int:
        return self.budget[0]

    @property
    def headroom_bytes(self) -> int:
        room = 1 << 62
        if self.limit_bytes:
            room = self.limit_bytes - self.charged_bytes
        if self.budget[0]:
            room = min(room, self.budget[0] - self.budget[1])
        return max(0, room)

    def try_charge(self, nbytes: int) -> bool:
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        if nbytes > self.headroom_bytes:
            return False
        self.charged_bytes += nbytes
        self.budget[1] += nbytes
        return True

    def uncharge(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.charged_bytes
        self.charged_bytes -= nbytes
        self.budget[1] -= nbytes

    def poll(self) -> Any:
        from types import SimpleNamespace

        events = SimpleNamespace(limit_changed=self.limit_changed, trim_requested=self.trim_requested)
        self.limit_changed = self.trim_requested = False
        return events

    def publish(self, snapshot: Any) -> None:
        self.published.append(snapshot)

    def observe(self, op: str, seconds: float) -> None:
        assert op in ("map", "unmap") and seconds >= 0
        self.samples.append((op, seconds))
