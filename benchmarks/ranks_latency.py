"""Round-trip latency of the ranks protocol: one-page map and unmap to 1, 2 and 4 ranks, per transport,
against the data-plane call alone. Not a test; prints a table (and JSON with --json).

    python benchmarks/ranks_latency.py [--iters 2000] [--ranks 1 2 4] [--json out.json] [--backend cuda:2]

Every rank serves a real ``SpaceGroup`` (host backend, or ``--backend cuda:N``: rank r on GPU r % N) with a
handle pool that keeps handles, as in production.
Transports: ``inproc`` (direct call, all ranks in this process), ``socket`` (one process per rank, Unix
sockets), ``pipe-rpc`` (one process per rank, an all-or-nothing broadcast over multiprocessing pipes: the
shape of an engine's worker RPC). ``dataplane`` is ``SpaceGroup.map``/``unmap`` called directly, once.
For reference, kvcached (sockets + pickle, a connection per message) reports ~2.1 ms per page at TP=4.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/elastic-kv-core/src"))

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

NUM_PAGES = 64


def make_backend(spec: str, r: int) -> Any:
    """``host``, or ``cuda:N`` (rank r on GPU r % N)."""
    if spec == "host":
        return _vmm.HostBackend()
    return _vmm.CudaBackend(r % int(spec.split(":")[1]))


def make_rank(r: int, spec: str = "host") -> tuple[Rank, Any]:
    """A rank serving one pool of NUM_PAGES pages; returns it and the objects to keep alive."""
    backend = make_backend(spec, r)
    page = backend.granularity
    pool = _vmm.HandlePool(backend, NUM_PAGES * page)
    space = _vmm.TensorSpace(backend, NUM_PAGES * page, page)
    group = _vmm.SpaceGroup([space], [(0, 0, page, page)], NUM_PAGES, pool)
    rank = Rank(r)
    rank.add_pool(group, backend=backend, handle_pool=pool)
    return rank, (backend, pool, space, group)


def serve(r: int, kind: str, address: str, ready: Any, conn: Any, spec: str) -> None:
    rank, _keep = make_rank(r, spec)
    if kind == "socket":
        listener = SocketListener(rank, address)
        ready.send(True)
        ready.recv()  # until told to stop
        listener.close()
        return
    ready.send(True)
    try:
        while True:
            conn.send_bytes(rank.handle(conn.recv_bytes()))
    except EOFError:
        pass


def pipe_broadcast(conns: Sequence[Any]) -> Callable[[bytes, float], list[bytes]]:
    def call(payload: bytes, timeout: float) -> list[bytes]:
        for c in conns:
            c.send_bytes(payload)
        return [c.recv_bytes() for c in conns]

    return call


def measure(c: Coordinator | None, group: Any, iters: int) -> dict[str, list[float]]:
    maps: list[float] = []
    unmaps: list[float] = []
    do_map = c.map if c is not None else group.map
    do_unmap = c.unmap if c is not None else group.unmap
    for i in range(iters + 100):
        pages = [i % NUM_PAGES]
        t0 = time.perf_counter()
        do_map(pages)
        t1 = time.perf_counter()
        do_unmap(pages)
        t2 = time.perf_counter()
        if i >= 100:  # warm-up: handle pool filled, caches warm
            maps.append(t1 - t0)
            unmaps.append(t2 - t1)
    return {"map": maps, "unmap": unmaps}


def run_processes(kind: str, n: int, iters: int, spec: str) -> dict[str, list[float]]:
    ctx = multiprocessing.get_context("spawn")
    instance = new_instance_name()
    paths = [socket_path(instance, r) for r in range(n)]
    procs, readies, conns = [], [], []
    for r in range(n):
        ready_parent, ready_child = ctx.Pipe()
        conn_parent, conn_child = ctx.Pipe()
        p = ctx.Process(
            target=serve, args=(r, kind, os.fspath(paths[r]), ready_child, conn_child, spec), daemon=True
        )
        p.start()
        procs.append(p)
        readies.append(ready_parent)
        conns.append(conn_parent)
    for ready in readies:
        ready.recv()
    transport: Any = (
        SocketTransport(paths) if kind == "socket" else BroadcastTransport(pipe_broadcast(conns), n)
    )
    try:
        return measure(Coordinator(transport), None, iters)
    finally:
        transport.close()
        for ready, conn in zip(readies, conns, strict=True):
            ready.send(True)
            conn.close()
        for p in procs:
            p.join(5)


def summarize(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": s[len(s) // 2] * 1e6,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
        "mean_us": statistics.fmean(s) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--backend", default="host", help="host, or cuda:N (rank r on GPU r %% N)")
    args = parser.parse_args()

    results: list[dict[str, Any]] = []

    def record(transport: str, n: int, samples: dict[str, list[float]]) -> None:
        for op, xs in samples.items():
            row = {"transport": transport, "ranks": n, "op": op, **summarize(xs)}
            results.append(row)
            print(
                f"{transport:10s} {n:2d} ranks  {op:5s}  p50 {row['p50_us']:8.1f} us  "
                f"p99 {row['p99_us']:8.1f} us  mean {row['mean_us']:8.1f} us",
                flush=True,
            )

    _rank, keep = make_rank(0, args.backend)
    record("dataplane", 1, measure(None, keep[3], args.iters))
    del _rank, keep
    for n in args.ranks:
        ranks = [make_rank(r, args.backend) for r in range(n)]
        transport = InProcessTransport([r for r, _ in ranks])
        record("inproc", n, measure(Coordinator(transport), None, args.iters))
    for kind in ("socket", "pipe-rpc"):
        for n in args.ranks:
            record(
                kind, n, run_processes("socket" if kind == "socket" else "pipe", n, args.iters, args.backend)
            )
    print(f"(host: {os.cpu_count()} CPUs; threads alive: {threading.active_count()})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
