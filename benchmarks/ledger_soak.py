"""Soak: a million random ledger operations against the real host data plane, invariants checked throughout.

    python -m benchmarks.ledger_soak --ops 1000000 [--seed 0] [--geometry straddling|aligned]

Not a CI test (it takes minutes). One pool over ``FaultInjectingBackend(HostBackend)`` with background
pre-mapping and deferred release on, driven by a weighted random mix: allocations of 1 block (decode) up to
a few hundred (prefill), whole and partial frees, epochs advanced and released with a lag, maintenance,
limit changes (the pool shrinking below its live blocks and growing back), trims, clears, injected driver
out-of-memory (handle creation) and rejected frees. The background mapping thread runs concurrently
(nothing waits for it), so allocations race it as in an engine.

Checked after every operation: each alloc returns exactly n ids, none live already; a refused free
changes nothing the model can see. Checked every ``--check-every`` operations and at the end: the ledger's
own invariants (``Ledger.check_invariants``), every live block's page mapped in the SpaceGroup, the
ledger's backed pages equal to the data plane's (pages in flight aside), and the charge equal to the data
plane's mapped bytes. Exits 1 on the first violation.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import LocalMapper

KIB = 1024


def geometry(kind: str) -> BlockGeometry:
    if kind == "aligned":  # 2 layers, 16 KiB blocks, 4 per 64 KiB slot
        return BlockGeometry.from_layer_strides(
            2 * 4096 * 16 * KIB, 4096, 2, 4096 * 16 * KIB, 16 * KIB, 16 * KIB, 64 * KIB
        )
    # 3 layers of 24 KiB blocks, layers not slot-aligned, pages of one slot: blocks straddle, slots shared
    layer = 3000 * 24 * KIB + 12 * KIB
    return BlockGeometry.from_layer_strides(
        3 * layer, 3000, 3, layer, 24 * KIB, 24 * KIB, 64 * KIB, max_page_slots=1
    )


def full_check(led: Ledger, group: _vmm.SpaceGroup, live: set[int]) -> None:
    led.check_invariants()
    geo = led.geometry
    ledger_live = {b for b in range(geo.num_blocks) if led.is_live(b)} - {led.null_block}
    assert ledger_live == live, f"live blocks differ: {sorted(ledger_live ^ live)[:10]}"
    mapped = set(group.mapped_pages())
    for b in live:
        assert geo.page_of(b) in mapped, f"live block {b} on unbacked page {geo.page_of(b)}"
    backed = set(led.mapped_pages())
    assert backed <= mapped, f"ledger holds pages the data plane does not map: {sorted(backed - mapped)}"
    snap = led.snapshot()
    if snap.inflight_pages == 0:
        assert mapped == backed, f"data plane maps pages the ledger does not hold: {sorted(mapped - backed)}"
        assert led.charged_bytes == group.mapped_bytes, f"charge {led.charged_bytes} != {group.mapped_bytes}"
    assert group.consistent, group.error


def soak(ops: int, seed: int, kind: str, check_every: int) -> int:
    rng = random.Random(seed)
    geo = geometry(kind)
    backend = _vmm.FaultInjectingBackend(_vmm.HostBackend(granularity=geo.page_size))
    mapper = LocalMapper.for_geometry(backend, geo, cached_bytes=8 * geo.page_bytes)
    cfg = ElasticConfig(
        page_size=geo.page_size,
        reserve_min_pages=2,
        reserve_max_pages=12,
        reserve_window=16,
        defer_release=True,
    )
    led = Ledger(geo, mapper, cfg)
    allocations: list[list[int]] = []
    live: set[int] = set()
    counts: Counter[str] = Counter()
    epochs_done = 0
    peak_pages = 0
    weights = {
        "alloc": 40, "free": 30, "partial_free": 6, "epoch": 8, "release": 8, "maintain": 6,
        "resize": 0.4, "trim": 0.2, "clear": 0.02, "oom": 0.3, "bad_free": 0.5,
    }  # fmt: skip
    names, cum = list(weights), list(weights.values())
    start = time.perf_counter()
    for i in range(1, ops + 1):
        op = rng.choices(names, cum)[0]
        if op == "alloc" and len(live) > 0.75 * geo.num_blocks:
            op = "free"  # keep the pool in its interesting range: full enough to refuse, not stuck full
        counts[op] += 1
        if op == "alloc":
            n = 1 if rng.random() < 0.7 else min(600, int(rng.paretovariate(1.2) * 8))
            got = led.alloc(n)
            if got is None:
                counts["alloc_refused"] += 1
            else:
                assert len(got) == n == len(set(got)), f"alloc({n}) returned {len(got)} ids"
                assert live.isdisjoint(got), "a block was issued twice"
                live.update(got)
                allocations.append(got)
        elif op in ("free", "partial_free") and allocations:
            index = rng.randrange(len(allocations))
            blocks = allocations[index]
            if op == "free" or len(blocks) == 1:
                allocations[index] = allocations[-1]
                allocations.pop()
                gone = blocks
            else:
                cut = rng.randrange(1, len(blocks))
                gone, allocations[index] = blocks[:cut], blocks[cut:]
            led.free(gone)
            live.difference_update(gone)
        elif op == "epoch":
            led.advance_epoch()
        elif op == "release":
            epochs_done = max(epochs_done, led.epoch - rng.randrange(3))
            led.release_through(epochs_done)
        elif op == "maintain":
            led.maintain()
        elif op == "resize":
            led.resize(rng.choice([0, 0, rng.randrange(8, 400) * geo.page_bytes]))
        elif op == "trim":
            led.trim()
        elif op == "clear":
            led.clear()
            live.clear()
            allocations.clear()
        elif op == "oom":
            # Only handle creation fails: a rollback never creates, so the data plane can always roll back.
            # (A second failure inside a rollback makes the group inconsistent by design; the unit tests
            # cover that path, a soak that stops there would test nothing more.)
            backend.fail("create", nth=rng.randrange(1, 4), error="oom")
        elif op == "bad_free":
            bad = rng.choice(
                [
                    -1,
                    geo.num_blocks,
                    *(b for b in range(rng.randrange(geo.num_blocks), geo.num_blocks)[:3] if b not in live),
                ]
            )
            try:
                led.free([bad])
            except ValueError:
                pass
            else:
                raise AssertionError(f"free([{bad}]) was accepted")
        peak_pages = max(peak_pages, led.snapshot().mapped_pages) if i % 97 == 0 else peak_pages
        if i % check_every == 0:
            full_check(led, mapper.group, live)
            counts["full_checks"] += 1
    led.settle()
    backend.clear()
    full_check(led, mapper.group, live)
    elapsed = time.perf_counter() - start
    snap = led.snapshot()
    print(f"{ops} operations in {elapsed:.1f} s ({ops / elapsed:,.0f} ops/s), seed {seed}, geometry {kind}")
    print(f"geometry: {geo.describe()}")
    print("operations:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(
        f"end: {snap.used_blocks} live blocks on {snap.mapped_pages} backed pages (peak {peak_pages} of "
        f"{snap.total_pages}), reserve {snap.reserve_pages}, pending {snap.pending_pages}, "
        f"reserve hit rate {snap.reserve_hit_rate:.3f} ({snap.reserve_hits} hits, "
        f"{snap.reserve_misses} misses)"
    )
    print(
        f"data plane: {backend.calls('map')} maps, {backend.calls('unmap')} unmaps, "
        f"{backend.injected('create')} injected failures, "
        f"{mapper.group.quarantined_handles} quarantined handles, consistent={mapper.group.consistent}"
    )
    led.close()
    assert mapper.group.num_mapped == 0, "close() left pages mapped"
    mapper.close()
    print("all invariants held")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--geometry", choices=["straddling", "aligned"], default="straddling")
    parser.add_argument("--check-every", type=int, default=5000)
    args = parser.parse_args(argv)
    try:
        return soak(args.ops, args.seed, args.geometry, args.check_every)
    except AssertionError as exc:
        print(f"INVARIANT VIOLATED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
