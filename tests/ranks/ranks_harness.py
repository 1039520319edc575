"""Test harness for the ranks protocol: real ranks (each with its own data-plane backend), in real processes.

A *cluster* is ``world`` ranks reachable through one transport kind:

* ``inproc`` -- ``Rank`` objects in the test process, ``InProcessTransport``;
* ``socket`` -- one spawned process per rank serving a ``SocketListener``, ``SocketTransport``;
* ``rpc``    -- one spawned process per rank serving ``Rank.handle`` on a pipe; the test process broadcasts
  with all-or-nothing semantics, like vLLM's ``collective_rpc`` (a timeout or a dead worker fails the whole
  call), through ``BroadcastTransport``.

Each rank process is driven by the test through a control pipe: add a pool (a fresh ``SpaceGroup`` on a
``FaultInjectingBackend(HostBackend())``), inject data-plane faults, make the rank die or stall at a chosen
protocol step, advance its epoch fence, read its counters. Processes are spawned once per module and respawned
only after a test killed one; each test uses a fresh pool id, so tests never see each other's state.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastic_kv import _vmm
from elastic_kv.ranks import (
    BroadcastTransport,
    Coordinator,
    InProcessTransport,
    Rank,
    SocketListener,
    SocketTransport,
    new_instance_name,
    socket_path,
)
from elastic_kv.ranks.messages import MessageError, Op, Reply, Request, peek_prefix

DIE_EXIT_CODE = 17
BUSY_WAIT_S = 0.5  # how long a MAP of a retiring page waits for its epoch
KINDS = ("inproc", "socket", "rpc")


class ManualCompletion:
    """A completion the test finishes by hand (stands for a CUDA event recorded after a step's kernels)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def set(self) -> None:
        self._done.set()


class ScriptedRank(Rank):
    """A Rank that can be told to die (``os._exit``) or stall at a chosen protocol step."""

    def __init__(self, rank: int, **kwargs: Any) -> None:
        super().__init__(rank, **kwargs)
        self.script: dict[Op, tuple[str, float]] = {}

    def dispatch(self, req: Request) -> Reply:
        action, arg = self.script.get(req.op, ("", 0.0))
        if action == "die_before":
            os._exit(DIE_EXIT_CODE)
        if action == "stall":  # one-shot, so that the retry of a stalled request goes through
            del self.script[req.op]
            time.sleep(arg)
        reply = super().dispatch(req)
        if action == "die_after":  # applied, reply never sent
            os._exit(DIE_EXIT_CODE)
        return reply


@dataclass
class PoolHandles:
    backend: Any
    handle_pool: Any
    group: Any
    empty: int  # live handles before the pool's space existed
    baseline: int  # live handles with nothing mapped
    per_page: int  # live handles one mapped page adds


class RankNode:
    """Everything one rank owns; the control commands of the harness are its methods."""

    def __init__(self, rank: int, device: str = "host") -> None:
        self.rank = ScriptedRank(rank, busy_wait=BUSY_WAIT_S)
        self.device = device
        self.pools: dict[int, PoolHandles] = {}
        self.completions: dict[int, ManualCompletion] = {}
        self.listener: SocketListener | None = None

    def _make_backend(self) -> Any:
        if self.device == "host":
            return _vmm.FaultInjectingBackend(_vmm.HostBackend())
        assert self.device == "cuda", self.device
        return _vmm.FaultInjectingBackend(_vmm.CudaBackend(self.rank.rank))  # rank r on GPU r

    def add_pool(self, pool: int, num_pages: int) -> tuple[int, int]:
        backend = self._make_backend()
        empty = backend.live_handles
        handle_pool = _vmm.HandlePool(backend, 0)  # no caching: a released handle is really gone
        page = backend.granularity
        space = _vmm.TensorSpace(backend, num_pages * page, page)
        group = _vmm.SpaceGroup([space], [(0, 0, page, page)], num_pages, handle_pool)
        baseline = backend.live_handles
        group.map([0])
        per_page = backend.live_handles - baseline
        group.unmap([0])
        assert backend.live_handles == baseline
        self.pools[pool] = PoolHandles(backend, handle_pool, group, empty, baseline, per_page)
        self.rank.add_pool(group, pool=pool, backend=backend, handle_pool=handle_pool)
        return baseline, per_page

    def fail(self, pool: int, op: str, nth: int = 1, times: int = 1, error: str = "oom") -> None:
        self.pools[pool].backend.fail(op, nth, times, error)

    def clear(self, pool: int) -> None:
        self.pools[pool].backend.clear()

    def script(self, op: int, action: str, arg: float = 0.0) -> None:
        if action:
            self.rank.script[Op(op)] = (action, arg)
        else:
            self.rank.script.pop(Op(op), None)

    def snapshot(self, pool: int) -> tuple[tuple[int, ...], int, bool, int]:
        """(mapped pages, live handles, consistent, queued unmaps), read directly from the data plane."""
        p = self.pools[pool]
        info = self.rank.info(pool)
        return tuple(p.group.mapped_pages()), p.backend.live_handles, info.consistent, info.queued_unmaps

    def drop_pool(self, pool: int) -> tuple[int, int]:
        """Stop serving ``pool`` and destroy its data-plane objects (what an engine does with a pool in the
        consistency-error state); return (live handles after, live handles before the pool existed)."""
        self.rank.remove_pool(pool)
        p = self.pools.pop(pool)
        p.group.close()
        backend, empty = p.backend, p.empty
        del p
        gc.collect()
        return int(backend.live_handles), empty

    def tx_state(self, pool: int, tx: int) -> str | None:
        """The data plane's record of transaction ``tx``."""
        return self.pools[pool].group.tx_state(tx)

    def failed_releases(self, pool: int) -> int:
        return int(self.pools[pool].handle_pool.failed_releases)

    def map_local(self, pool: int, pages: list[int]) -> None:
        self.pools[pool].group.map(pages)

    def finish_epoch(self, epoch: int) -> None:
        self.rank.finish_epoch(epoch)

    def record_epoch(self, epoch: int) -> None:
        self.completions[epoch] = completion = ManualCompletion()
        self.rank.record_epoch(epoch, completion)

    def complete_epoch(self, epoch: int) -> None:
        self.completions[epoch].set()

    def set_busy_wait(self, seconds: float) -> None:
        self.rank.busy_wait = seconds

    def fence(self) -> int:
        return self.rank.fence.finished

    def in_flight(self) -> bool:
        assert self.listener is not None
        return self.listener.in_flight

    def close_listener(self, timeout: float) -> tuple[bool, bool]:
        assert self.listener is not None
        drained = self.listener.close(timeout)
        return drained, self.listener.path.exists()


def rank_main(
    rank: int,
    kind: str,
    address: str,
    ctrl: multiprocessing.connection.Connection,
    rpc: multiprocessing.connection.Connection | None,
    device: str = "host",
) -> None:
    """Entry point of a rank process: serve the protocol on ``kind``, obey control commands."""
    logging.basicConfig(level=logging.ERROR)
    node = RankNode(rank, device)
    if kind == "socket":
        node.listener = SocketListener(node.rank, address)
    elif kind == "rpc":
        assert rpc is not None

        def serve_rpc() -> None:
            with contextlib.suppress(EOFError, OSError):
                while True:
                    rpc.send_bytes(node.rank.handle(rpc.recv_bytes()))

        threading.Thread(target=serve_rpc, daemon=True).start()
    ctrl.send(("ready", os.getpid()))
    while True:
        try:
            cmd, args = ctrl.recv()
        except EOFError:
            break
        if cmd == "exit":
            break
        try:
            ctrl.send(("ok", getattr(node, cmd)(*args)))
        except Exception as exc:
            ctrl.send(("err", repr(exc)))
    if node.listener is not None:
        node.listener.close(1.0)


class Cluster:
    """``world`` ranks of one transport kind; see the module docstring."""

    def __init__(self, kind: str, world: int, device: str = "host") -> None:
        assert kind in KINDS, kind
        self.kind = kind
        self.world = world
        self.device = device
        self._next_pool = 1
        self.instance = new_instance_name()
        self.paths = [socket_path(self.instance, r) for r in range(world)]
        self.nodes: list[RankNode] = []
        self.procs: list[Any] = [None] * world
        self.ctrls: list[multiprocessing.connection.Connection] = [None] * world  # type: ignore[list-item]
        self.rpcs: list[multiprocessing.connection.Connection | None] = [None] * world
        self.pools: dict[int, tuple[list[int], list[int]]] = {}  # pool -> (baselines, per_page) per rank
        self._transports: list[Any] = []
        if kind == "inproc":
            self.nodes = [RankNode(r, device) for r in range(world)]
        else:
            self._ctx = multiprocessing.get_context("spawn")
            for r in range(world):
                self._spawn(r)
            for r in range(world):
                self._await_ready(r)

    # --- processes ------------------------------------------------------------------------------
    def _spawn(self, r: int) -> None:
        parent_ctrl, child_ctrl = self._ctx.Pipe()
        parent_rpc, child_rpc = self._ctx.Pipe() if self.kind == "rpc" else (None, None)
        proc = self._ctx.Process(
            target=rank_main,
            args=(r, self.kind, os.fspath(self.paths[r]), child_ctrl, child_rpc, self.device),
            daemon=True,
            name=f"rank{r}",
        )
        proc.start()
        child_ctrl.close()
        if child_rpc is not None:
            child_rpc.close()
        self.procs[r], self.ctrls[r], self.rpcs[r] = proc, parent_ctrl, parent_rpc

    def _await_ready(self, r: int) -> None:
        if not self.ctrls[r].poll(60):
            raise RuntimeError(f"rank {r} did not start")
        assert self.ctrls[r].recv()[0] == "ready"

    def alive(self, r: int) -> bool:
        return self.kind == "inproc" or self.procs[r].is_alive()

    def kill(self, r: int) -> None:
        """SIGKILL rank ``r``'s process."""
        assert self.kind != "inproc"
        self.procs[r].kill()
        self.procs[r].join(10)

    def wait_dead(self, r: int, timeout: float = 10.0) -> int:
        """Wait for rank ``r``'s process to exit (it was scripted to die); return its exit code."""
        self.procs[r].join(timeout)
        assert not self.procs[r].is_alive(), f"rank {r} is still alive"
        return int(self.procs[r].exitcode)

    def revive(self) -> None:
        """Respawn every dead rank process (a fresh process knows no pool)."""
        if self.kind == "inproc":
            return
        dead = [r for r in range(self.world) if not self.procs[r].is_alive()]
        for r in dead:
            self.procs[r].join()
            self.ctrls[r].close()
            if self.rpcs[r] is not None:
                self.rpcs[r].close()  # type: ignore[union-attr]
            self._spawn(r)
        for r in dead:
            self._await_ready(r)

    # --- control ---------------------------------------------------------------------------------
    def ctl(self, r: int, cmd: str, *args: Any) -> Any:
        """Run control command ``cmd`` on rank ``r``; AssertionError carries a remote exception."""
        if self.kind == "inproc":
            return getattr(self.nodes[r], cmd)(*args)
        self.ctrls[r].send((cmd, args))
        status, value = self.ctrls[r].recv()
        assert status == "ok", f"rank {r} {cmd}{args}: {value}"
        return value

    def wait_in_flight(self, r: int, timeout: float = 10.0) -> None:
        """Block until rank ``r``'s listener is applying a request (socket clusters)."""
        deadline = time.monotonic() + timeout
        while not self.ctl(r, "in_flight"):
            assert time.monotonic() < deadline, f"rank {r} never started the request"
            time.sleep(0.005)

    def new_pool(self, num_pages: int = 16) -> int:
        """Add a fresh pool on every rank; returns its id."""
        pool = self._next_pool
        self._next_pool += 1
        stats = [self.ctl(r, "add_pool", pool, num_pages) for r in range(self.world)]
        self.pools[pool] = ([b for b, _ in stats], [p for _, p in stats])
        return pool

    def transport(self) -> Any:
        if self.kind == "inproc":
            t: Any = InProcessTransport([n.rank for n in self.nodes])
        elif self.kind == "socket":
            t = SocketTransport(self.paths)
        else:
            t = BroadcastTransport(
                self._rpc_call, self.world, gone_errors=(EOFError, BrokenPipeError, ConnectionError)
            )
        self._transports.append(t)
        return t

    def coordinator(self, pool: int, *, timeout: float = 2.0, retries: int = 3) -> Coordinator:
        return Coordinator(
            self.transport(), pool=pool, timeout=timeout, retries=retries, handshake_timeout=30
        )

    def _rpc_call(self, payload: bytes, timeout: float) -> Sequence[bytes]:
        """All-or-nothing broadcast over pipes, with collective_rpc's semantics."""
        try:
            request_id: int | None = peek_prefix(payload)[2]
        except MessageError:  # a test sends garbage on purpose: take whatever comes back
            request_id = None
        conns = [c for c in self.rpcs if c is not None]
        for conn in conns:
            conn.send_bytes(payload)
        replies: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(conns):
            waiting = [c for i, c in enumerate(conns) if i not in replies]
            ready = multiprocessing.connection.wait(waiting, max(deadline - time.monotonic(), 0))
            if not ready:
                raise TimeoutError(f"{len(waiting)} workers did not answer within {timeout}s")
            for ready_conn in ready:
                i = next(k for k, c in enumerate(conns) if c is ready_conn)
                data = conns[i].recv_bytes()
                if request_id is None or peek_prefix(data)[2] == request_id:  # else: a stale reply
                    replies[i] = data
        return [replies[i] for i in range(len(conns))]

    # --- checks ----------------------------------------------------------------------------------
    def snapshots(self, pool: int) -> dict[int, tuple[tuple[int, ...], int, bool, int]]:
        """Per living rank: (mapped pages, live handles, consistent, queued unmaps)."""
        return {r: self.ctl(r, "snapshot", pool) for r in range(self.world) if self.alive(r)}

    def assert_no_leaks(self, pool: int, ranks: Sequence[int] | None = None) -> None:
        """Every given (default: living) rank holds exactly the handles its mapped pages need."""
        baselines, per_page = self.pools[pool]
        for r, (pages, live, _consistent, _queued) in self.snapshots(pool).items():
            if ranks is not None and r not in ranks:
                continue
            expected = baselines[r] + per_page[r] * len(pages)
            assert live == expected, (
                f"rank {r}: {live} live handles, expected {expected} for {len(pages)} pages"
            )

    def assert_agree(self, pool: int, pages: Sequence[int] | None = None) -> tuple[int, ...]:
        """Every living rank is consistent and maps the same pages (``pages`` if given); no leaks."""
        snaps = self.snapshots(pool)
        mapped = {s[0] for s in snaps.values()}
        assert len(mapped) == 1, f"ranks diverge: { {r: s[0] for r, s in snaps.items()} }"
        assert all(s[2] for s in snaps.values()), f"a rank is inconsistent: {snaps}"
        self.assert_no_leaks(pool)
        got = mapped.pop()
        if pages is not None:
            assert got == tuple(sorted(pages)), f"ranks map {got}, expected {sorted(pages)}"
        return got

    def reset_scripts(self) -> None:
        for r in range(self.world):
            if self.alive(r):
                for op in Op:
                    self.ctl(r, "script", int(op), "")

    def close(self) -> None:
        for t in self._transports:
            t.close()
        if self.kind == "inproc":
            return
        for r in range(self.world):
            if self.procs[r].is_alive():
                with contextlib.suppress(OSError):
                    self.ctrls[r].send(("exit", ()))
        for r in range(self.world):
            self.procs[r].join(5)
            if self.procs[r].is_alive():
                self.procs[r].kill()
                self.procs[r].join()
