"""TEMPORARY pure-Python stand-in for elastic_kv._vmm, used only until the data plane lands on this branch.

Delete once `from elastic_kv import _vmm` works here; the suite must drive the real SpaceGroup.
"""

from __future__ import annotations

from elastic_kv.errors import PoolExhausted, StateConsistencyError


class HostBackend:
    def __init__(self, granularity: int = 0, physical_budget: int = 0) -> None:
        self.granularity = granularity or 4096
        self.budget = physical_budget
        self.live_handles = 0
        self.live_bytes = 0
        self.name = "host"


class FaultInjectingBackend:
    def __init__(self, inner: HostBackend) -> None:
        self.inner = inner
        self._faults: dict[str, list[int]] = {}
        self._calls: dict[str, int] = {}
        self.name = f"fault({inner.name})"
        self.granularity = inner.granularity

    @property
    def live_handles(self) -> int:
        return self.inner.live_handles

    def fail(self, op: str, nth: int = 1, times: int = 1, error: str = "oom") -> None:
        self._faults[op] = [self._calls.get(op, 0) + nth, times, 0 if error == "oom" else 1]

    def clear(self) -> None:
        self._faults.clear()

    def calls(self, op: str) -> int:
        return self._calls.get(op, 0)

    def call(self, op: str) -> None:
        self._calls[op] = n = self._calls.get(op, 0) + 1
        f = self._faults.get(op)
        if f and n >= f[0] and f[1] > 0:
            f[1] -= 1
            if f[2] == 0 and op == "create":
                raise PoolExhausted(f"injected oom in {op}")
            raise RuntimeError(f"injected error in {op}")


class HandlePool:
    def __init__(self, backend: FaultInjectingBackend, max_cached_bytes: int) -> None:
        self.backend = backend
        self.cached_handles = 0


class TensorSpace:
    def __init__(self, backend: FaultInjectingBackend, size: int, page_size: int) -> None:
        backend.call("create")
        backend.inner.live_handles += 1  # zero page
        self.page_size = page_size
        self.size = size


class SpaceGroup:
    def __init__(self, spaces, extents, num_pages: int, pool: HandlePool, history: int = 1024) -> None:  # type: ignore[no-untyped-def]
        self.backend = pool.backend
        self.num_pages = num_pages
        self._mapped: set[int] = set()
        self._tx: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.consistent = True
        self.error = ""
        self.page_size = spaces[0].page_size

    def _ok(self) -> None:
        if not self.consistent:
            raise StateConsistencyError(self.error)

    def map(self, pages) -> None:  # type: ignore[no-untyped-def]
        self._ok()
        pages = list(pages)
        for p in pages:
            if not 0 <= p < self.num_pages or p in self._mapped or pages.count(p) > 1:
                raise ValueError(f"bad page {p}")
        done = []
        try:
            for p in pages:
                self.backend.call("create")
                self.backend.inner.live_handles += 1
                try:
                    self.backend.call("map")
                except Exception:
                    self.backend.inner.live_handles -= 1
                    raise
                done.append(p)
        except Exception as exc:
            self.backend.inner.live_handles -= len(done)
            if isinstance(exc, PoolExhausted):
                raise
            raise PoolExhausted(str(exc)) from None
        self._mapped.update(pages)

    def prepare(self, tx: int, pages) -> None:  # type: ignore[no-untyped-def]
        self._ok()
        if tx in self._tx:
            raise ValueError("tx known")
        for p in pages:
            if p not in self._mapped:
                raise ValueError(f"page {p} not mapped")
        for _ in pages:
            try:
                self.backend.call("unmap")
            except Exception as exc:
                raise ValueError(str(exc)) from None
        self._mapped.difference_update(pages)
        self._tx[tx] = ("prepared", tuple(pages))

    def commit(self, tx: int) -> None:
        self._ok()
        state, pages = self._tx[tx]
        if state == "committed":
            return
        if state != "prepared":
            raise ValueError(state)
        for _ in pages:
            try:
                self.backend.call("release")
            except Exception as exc:
                self.consistent, self.error = False, str(exc)
                raise StateConsistencyError(str(exc)) from None
            self.backend.inner.live_handles -= 1
        self._tx[tx] = ("committed", pages)

    def abort(self, tx: int) -> None:
        self._ok()
        state, pages = self._tx[tx]
        if state == "aborted":
            return
        if state != "prepared":
            raise ValueError(state)
        for _ in pages:
            try:
                self.backend.call("map")
            except Exception as exc:
                self.consistent, self.error = False, str(exc)
                raise StateConsistencyError(str(exc)) from None
        self._mapped.update(pages)
        self._tx[tx] = ("aborted", pages)

    def unmap(self, pages) -> None:  # type: ignore[no-untyped-def]
        tx = -len(self._tx) - 1
        self.prepare(tx, pages)
        self.commit(tx)

    def tx_state(self, tx: int) -> str | None:
        return self._tx.get(tx, (None,))[0]

    def is_mapped(self, page: int) -> bool:
        return page in self._mapped

    def mapped_pages(self) -> list[int]:
        return sorted(self._mapped)

    @property
    def num_mapped(self) -> int:
        return len(self._mapped)

    @property
    def mapped_bytes(self) -> int:
        return len(self._mapped) * self.page_size
