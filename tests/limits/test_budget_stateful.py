"""Stateful property test: pools, limits and a device budget against a plain model of the rules.

Several records in one process (each has its own descriptors, so they exclude each other exactly as
separate processes do) are created, charged, uncharged, re-limited and closed at random while the
operator changes the budget. After every step the shared-memory state must equal the model, and the
model states the rules: a charge succeeds iff the pool's charge stays within its limit and the device's
sum within its budget.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from elastic_kv.registry import UNBOUNDED, PoolRecord
from elastic_kv.registry_view import Registry
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

KiB = 1 << 10
amounts = st.integers(min_value=0, max_value=64 * KiB)
limits = st.sampled_from([0, 16 * KiB, 48 * KiB, 128 * KiB])


class BudgetMachine(RuleBasedStateMachine):
    pools = Bundle("pools")

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="ekv-stateful-"))
        self.directory = self.tmp / "registry"
        self.registry = Registry(self.directory)
        self.budget = 0
        self.records: dict[str, PoolRecord] = {}
        self.charged: dict[str, int] = {}
        self.limit: dict[str, int] = {}
        self.pending_limit_event: dict[str, bool] = {}
        self.created = 0

    def teardown(self) -> None:
        for record in self.records.values():
            record.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @precondition(lambda self: len(self.records) < 4)
    @rule(target=pools, limit=limits)
    def create(self, limit: int) -> str:
        self.created += 1
        name = f"p{self.created}"
        self.records[name] = PoolRecord.create(
            name, device="gpu0", engine="e", model="m", limit_bytes=limit, registry_dir=self.directory
        )
        self.charged[name] = 0
        self.limit[name] = limit
        self.pending_limit_event[name] = False
        return name

    @rule(name=consumes(pools))
    def close(self, name: str) -> None:
        self.records.pop(name).close()
        del self.charged[name], self.limit[name], self.pending_limit_event[name]

    @rule(name=pools, nbytes=amounts)
    def charge(self, name: str, nbytes: int) -> None:
        total = sum(self.charged.values())
        fits_limit = self.limit[name] == 0 or self.charged[name] + nbytes <= self.limit[name]
        fits_budget = self.budget == 0 or total + nbytes <= self.budget
        expected = nbytes == 0 or (fits_limit and fits_budget)
        assert self.records[name].try_charge(nbytes) == expected
        if expected:
            self.charged[name] += nbytes

    @rule(name=pools, data=st.data())
    def uncharge(self, name: str, data: st.DataObject) -> None:
        nbytes = data.draw(st.integers(min_value=0, max_value=self.charged[name] + 1))
        if nbytes > self.charged[name]:
            try:
                self.records[name].uncharge(nbytes)
            except ValueError:
                return
            raise AssertionError("uncharging more than charged must fail")
        self.records[name].uncharge(nbytes)
        self.charged[name] -= nbytes

    @rule(name=pools, limit=limits)
    def set_limit(self, name: str, limit: int) -> None:
        self.registry.set_limit(name, limit)
        self.limit[name] = limit
        self.pending_limit_event[name] = True

    @rule(budget=st.sampled_from([0, 32 * KiB, 96 * KiB, 256 * KiB]))
    def set_budget(self, budget: int) -> None:
        self.registry.set_budget("gpu0", budget)
        self.budget = budget
        for name in self.pending_limit_event:
            self.pending_limit_event[name] = True

    @rule(name=pools)
    def poll(self, name: str) -> None:
        events = self.records[name].poll()
        assert events.limit_changed == self.pending_limit_event[name]
        assert not events.trim_requested
        self.pending_limit_event[name] = False

    @invariant()
    def shared_state_matches_the_model(self) -> None:
        for name, record in self.records.items():
            assert record.charged_bytes == self.charged[name]
            assert record.limit_bytes == self.limit[name]
            room = UNBOUNDED if self.limit[name] == 0 else self.limit[name] - self.charged[name]
            if self.budget:
                room = min(room, self.budget - sum(self.charged.values()))
            assert record.headroom_bytes == max(0, room)
        device = [d for d in self.registry.devices(reclaim=False) if d.device == "gpu0"]
        if device:
            assert device[0].charged_bytes == sum(self.charged.values())
            assert sorted(device[0].pools) == sorted(self.records)
        assert sorted(p.name for p in self.registry.pools(reclaim=False)) == sorted(self.records)


BudgetMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestBudgetMachine = BudgetMachine.TestCase
