"""A hypothesis state machine over the ledger and the real host data plane.

Rules: alloc, free (whole or partial), bad frees, resize, trim, clear, advance_epoch, release_through,
maintain, injected driver out-of-memory and a squeezed GPU-wide budget. After every step: no block is
issued twice, every page with a live block is mapped in the SpaceGroup, the ledger's backed pages are the
data plane's (in-flight background maps aside), the charge equals the data plane's mapped bytes and the
record's charge, and a pool over its limit never grows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from elastic_kv.config import ElasticConfig
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from .ledger_helpers import (
    SLOT,
    BudgetRecord,
    Pool,
    check_invariants,
    fingerprint,
    make_pool,
    small_geometry,
    straddling_geometry,
)


def settled(method: Callable[..., None]) -> Callable[..., None]:
    """Run a rule on a settled pool: background maps queued by earlier rules have landed, so that every
    rule's outcome depends on the rules before it, never on the background thread's timing (hypothesis
    replays examples and needs that). Allocation racing the background thread is covered by the unit
    tests and the soak."""

    @functools.wraps(method)
    def wrapper(self: LedgerMachine, *args: Any, **kwargs: Any) -> None:
        self.pool.ledger.settle()
        method(self, *args, **kwargs)

    return wrapper


class LedgerMachine(RuleBasedStateMachine):
    pool: Pool
    record: BudgetRecord

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[list[int]] = []
        self.live: set[int] = set()
        self.over_limit_charge: int | None = None

    @initialize(
        kind=st.sampled_from(["aligned", "straddling"]),
        defer=st.booleans(),
        premap=st.booleans(),
        reserve_max=st.integers(0, 4),
        null=st.sampled_from([0, None]),
    )
    def setup(self, kind: str, defer: bool, premap: bool, reserve_max: int, null: int | None) -> None:
        geo = small_geometry(48) if kind == "aligned" else straddling_geometry(30)
        cfg = ElasticConfig(
            page_size=SLOT,
            premap=premap,
            defer_release=defer,
            reserve_min_pages=min(1, reserve_max),
            reserve_max_pages=reserve_max,
            reserve_window=4,
            publish_interval_s=0,
        )
        self.record = BudgetRecord()
        self.pool = make_pool(geo, cfg, fault=True, record=self.record, null_block=null)
        self.page_bytes = geo.page_bytes

    # -- rules ------------------------------------------------------------------------------------------

    @rule(n=st.integers(1, 14))
    @settled
    def alloc(self, n: int) -> None:
        led = self.pool.ledger
        quiet = not led._book.inflight  # no background map can land during this call
        before = fingerprint(self.pool) if quiet else None
        got = led.alloc(n)
        if got is None:
            if before is not None:
                assert fingerprint(self.pool) == before, "a refused alloc changed state"
            return
        assert len(got) == n == len(set(got))
        assert not (set(got) & self.live), "a block was issued twice"
        assert not led.holds_draining(got), "a block was issued on a page being released"
        self.live |= set(got)
        self.allocations.append(got)

    @rule(pick=st.integers(0, 1 << 16), whole=st.booleans(), cut=st.integers(1, 1 << 16))
    @settled
    def free(self, pick: int, whole: bool, cut: int) -> None:
        # (draws never depend on the pool's state, so hypothesis can replay an example exactly)
        if not self.allocations:
            return
        index = pick % len(self.allocations)
        blocks = self.allocations[index]
        if whole or len(blocks) == 1:
            self.allocations.pop(index)
            gone = blocks
        else:
            cut = 1 + cut % (len(blocks) - 1)
            gone, self.allocations[index] = blocks[:cut], blocks[cut:]
        self.pool.ledger.free(gone)
        self.live -= set(gone)

    @rule(pick=st.integers(0, 1 << 16))
    @settled
    def bad_free(self, pick: int) -> None:
        led = self.pool.ledger
        num = led.geometry.num_blocks
        dead = [b for b in range(num) if not led.is_live(b)]
        candidates = [-1, num, *dead[:5]] + ([led.null_block] if led.null_block is not None else [])
        bad = candidates[pick % len(candidates)]
        good = sorted(self.live)[:2]
        before = fingerprint(self.pool)
        try:
            led.free([*good, bad])
        except ValueError:
            pass
        else:
            raise AssertionError(f"free of {bad} was accepted")
        assert fingerprint(self.pool) == before

    @rule(pages=st.integers(0, 14))
    @settled
    def resize(self, pages: int) -> None:
        self.pool.ledger.resize(pages * self.page_bytes)

    @rule()
    @settled
    def trim(self) -> None:
        self.pool.ledger.trim()

    @rule()
    @settled
    def clear(self) -> None:
        self.pool.ledger.clear()
        self.live.clear()
        self.allocations.clear()

    @rule()
    @settled
    def advance_epoch(self) -> None:
        self.pool.ledger.advance_epoch()

    @rule(back=st.integers(0, 3))
    @settled
    def release_through(self, back: int) -> None:
        led = self.pool.ledger
        led.release_through(max(0, led.epoch - back))

    @rule()
    @settled
    def maintain(self) -> None:
        self.pool.ledger.maintain()

    @rule(blocks=st.integers(0, 60))
    @settled
    def expect(self, blocks: int) -> None:
        """Requests arrived: maps queued ahead (landing before the next rule), never beyond the reserve's
        cap or the limit (the invariants check both)."""
        self.pool.ledger.expect(blocks)

    @rule(nth=st.integers(1, 3))
    @settled
    def inject_out_of_memory(self, nth: int) -> None:
        self.pool.backend.fail("create", nth=nth, error="oom")

    @rule(extra_pages=st.integers(0, 3))
    @settled
    def squeeze_budget(self, extra_pages: int) -> None:
        """Another engine takes the GPU-wide budget down to what we hold plus a few pages (or frees it)."""
        self.record.budget[0] = self.record.budget[1] + extra_pages * self.page_bytes if extra_pages else 0

    # -- invariants -------------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.pool, self.live)
        led = self.pool.ledger
        assert self.record.charged_bytes == led.charged_bytes
        limit = led.snapshot().limit_bytes
        if limit and led.charged_bytes > limit:
            assert led.snapshot().reserve_pages == 0, "a pool over its limit keeps a reserve"
            if self.over_limit_charge is not None:
                assert led.charged_bytes <= self.over_limit_charge, "a pool over its limit grew"
            self.over_limit_charge = led.charged_bytes
        else:
            self.over_limit_charge = None

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.backend.clear()
        self.pool.close()
        assert self.record.charged_bytes == 0
        assert self.pool.group.closed


LedgerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_ledger_state_machine = LedgerMachine.TestCase
