"""Stateful property test: pools, limits and a device budget against a plain model of the rules.

Several records are created, charged, uncharged, re-limited and closed at random while the operator
changes the budget. After every step the shared-memory state must equal the model, and the model states
the rules: a charge succeeds iff the pool's charge stays within its limit and the device's sum within its
budget.

:class:`BudgetMachine` keeps every record in this process (each has its own descriptors, so they exclude
each other exactly as separate processes do). :class:`ProcessBudgetMachine` runs the same rules with every
pool owned by its own process (``pool_worker.py``), and adds a race: every pool charges at once, its
request written to all processes before any reply is read. The outcome must be one some order of those
charges would give (the budget is atomic across processes), and the sum never passes the budget.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from elastic_kv.registry import UNBOUNDED, PoolRecord, RecordEvents, Registry
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from limits.conftest import PACKAGE_ROOT
from limits.helpers import PoolProcess

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

    def open_record(self, name: str, limit: int) -> Any:
        """A new pool's record (here: in this process)."""
        return PoolRecord.create(
            name, device="gpu0", engine="e", model="m", limit_bytes=limit, registry_dir=self.directory
        )

    @precondition(lambda self: len(self.records) < 4)
    @rule(target=pools, limit=limits)
    def create(self, limit: int) -> str:
        self.created += 1
        name = f"p{self.created}"
        self.records[name] = self.open_record(name, limit)
        self.charged[name] = 0
        self.limit[name] = limit
        self.pending_limit_event[name] = False
        return name

    @rule(name=consumes(pools))
    def close(self, name: str) -> None:
        self.records.pop(name).close()
        del self.charged[name], self.limit[name], self.pending_limit_event[name]

    def fits(self, charged: dict[str, int], name: str, nbytes: int) -> bool:
        """The rule: a charge succeeds iff it keeps the pool within its limit and the device within its
        budget."""
        fits_limit = self.limit[name] == 0 or charged[name] + nbytes <= self.limit[name]
        fits_budget = self.budget == 0 or sum(charged.values()) + nbytes <= self.budget
        return nbytes == 0 or (fits_limit and fits_budget)

    @rule(name=pools, nbytes=amounts)
    def charge(self, name: str, nbytes: int) -> None:
        expected = self.fits(self.charged, name, nbytes)
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


def _answer(command: str, key: str) -> property:
    """A read-only attribute of a :class:`_RemoteRecord`: ``key`` of its worker's answer to ``command``,
    asked at every read."""
    return property(lambda record: int(record.worker.send(command)[key]))


class _RemoteRecord:
    """The part of :class:`PoolRecord` the machine uses, for a record owned by a ``pool_worker`` process."""

    def __init__(self, worker: PoolProcess) -> None:
        self.worker = worker

    def try_charge(self, nbytes: int) -> bool:
        return bool(self.worker.send(f"charge {nbytes}")["ok"])

    def uncharge(self, nbytes: int) -> None:
        reply = self.worker.send(f"uncharge {nbytes}")
        if not reply["ok"]:
            raise ValueError(reply["error"])

    charged_bytes = _answer("state", "charged")
    limit_bytes = _answer("state", "limit")
    budget_bytes = _answer("state", "budget")
    headroom_bytes = _answer("headroom", "headroom")

    def poll(self) -> RecordEvents:
        reply = self.worker.send("poll")
        return RecordEvents(limit_changed=reply["limit_changed"], trim_requested=reply["trim_requested"])

    def close(self) -> None:
        self.worker.send("close")
        self.worker.finish()


class ProcessBudgetMachine(BudgetMachine):
    """:class:`BudgetMachine` with every pool owned by its own process, plus charges racing each other."""

    def open_record(self, name: str, limit: int) -> Any:
        env = {**os.environ, "ELASTIC_KV_REGISTRY_DIR": str(self.directory)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
        return _RemoteRecord(PoolProcess(env, name, device="gpu0", limit=limit))

    @precondition(lambda self: len(self.records) >= 2)
    @rule(data=st.data())
    def race(self, data: st.DataObject) -> None:
        names = sorted(self.records)
        asked = {name: data.draw(amounts, label=f"charge of {name}") for name in names}
        workers = {name: self.records[name].worker for name in names}
        for name in names:  # every request is on its way before any answer is read
            stdin = workers[name].proc.stdin
            assert stdin is not None
            stdin.write(f"charge {asked[name]}\n")
            stdin.flush()
        got = {name: bool(workers[name].read_reply()["ok"]) for name in names}
        # Some order of the charges, each judged by the rule on the state the earlier ones left, gives
        # exactly these outcomes.
        for order in itertools.permutations(names):
            charged = dict(self.charged)
            for name in order:
                if self.fits(charged, name, asked[name]) != got[name]:
                    break
                charged[name] += asked[name] if got[name] else 0
            else:
                self.charged = charged
                return
        raise AssertionError(f"no order of the charges {asked} gives {got} from {self.charged}")

    def teardown(self) -> None:
        for record in self.records.values():
            if record.worker.proc.poll() is None:
                record.worker.kill()
            for stream in (record.worker.proc.stdin, record.worker.proc.stdout, record.worker.proc.stderr):
                if stream is not None:
                    stream.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


ProcessBudgetMachine.TestCase.settings = settings(max_examples=10, stateful_step_count=20, deadline=None)
TestProcessBudgetMachine = ProcessBudgetMachine.TestCase
