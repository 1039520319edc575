"""What mapping one logical page costs a vLLM worker's rank on a GPU, with the GPU idle or busy.

A pool shaped like vLLM 0.26's for Llama-3-8B (``--layers`` spaces, one slot of ``--slot-mib`` per layer and
page) maps ``--pages`` pages one at a time, as the plugin's background jobs do, and reports the median
milliseconds per page for:

* ``map``: ``SpaceGroup.map`` alone (per layer: unmap the zero page, create or reuse a handle, map, set
  access);
* ``map + zero, waited``: then zero the page's blocks on a side stream and synchronize it (what the worker
  did before it ordered the engine's next step after the memsets instead);
* ``map + zero, queued``: the memsets queued, not waited for (what the worker does now).

Each runs with the GPU idle and with another thread keeping it busy with large matmuls (a prefill's
stand-in). Driver calls run on the calling thread, so wall and thread-CPU time are both printed. The handle
pool keeps (``--pooled``) or releases the handles between rounds.

    python benchmarks/map_under_load.py [--layers 32] [--slot-mib 8] [--pages 52] [--pooled]

On the H200 (2026-11-30, 32 x 8 MiB, fresh handles; measured by this script's prototype, the same rounds
without the ``queued`` row; this version has not run on the GPU yet): ``map`` 2.6 ms idle, 2.9 ms busy;
``map + zero, waited`` 3.4 ms idle, 6.5 ms busy (the memsets queue behind the matmuls).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Iterator

import torch
from elastic_kv import _vmm

MiB = 1 << 20


class _Pool:
    def __init__(self, layers: int, slot: int, pages: int, pooled: bool) -> None:
        backend = _vmm.CudaBackend(0)
        self.slot = slot
        self.spaces = [_vmm.TensorSpace(backend, pages * slot, slot) for _ in range(layers)]
        self.flats = [torch.from_dlpack(s) for s in self.spaces]
        handles = _vmm.HandlePool(backend, layers * pages * slot if pooled else 0)
        extents = [(s, 0, slot, slot) for s in range(layers)]
        self.group = _vmm.SpaceGroup(self.spaces, extents, pages, handles)
        self.stream = torch.cuda.Stream()

    def map(self, page: int, zero: str) -> None:
        self.group.map([page])
        if zero == "none":
            return
        with torch.cuda.stream(self.stream):
            for flat in self.flats:
                flat[page * self.slot : (page + 1) * self.slot].zero_()
        if zero == "waited":
            self.stream.synchronize()

    def round(self, pages: int, zero: str) -> tuple[float, float]:
        """Median wall and thread-CPU ms per page of mapping ``pages`` pages, then unmap them all."""
        walls, cpus = [], []
        for page in range(pages):
            t, c = time.perf_counter(), time.thread_time()
            self.map(page, zero)
            walls.append(time.perf_counter() - t)
            cpus.append(time.thread_time() - c)
        self.stream.synchronize()
        self.group.unmap(list(range(pages)))
        return 1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)


@contextlib.contextmanager
def _busy_gpu() -> Iterator[None]:
    """Another thread keeps the GPU busy with 8192^2 bf16 matmuls, 20 at a time, until the block ends."""
    stop = threading.Event()

    def work() -> None:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(20):
                    torch.mm(a, a)
                stream.synchronize()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    time.sleep(1.0)
    try:
        yield
    finally:
        stop.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--slot-mib", type=int, default=8)
    parser.add_argument("--pages", type=int, default=52, help="pages mapped per round (a burst's growth)")
    parser.add_argument("--pooled", action="store_true", help="reuse handles between rounds")
    args = parser.parse_args()
    pool = _Pool(args.layers, args.slot_mib * MiB, args.pages, args.pooled)
    pool.round(args.pages, "waited")  # warm-up: first kernels, the handle pool
    print(f"{args.layers} layers x {args.slot_mib} MiB slots, {args.pages} pages a round, ms per page")
    print(f"{'':24s} {'GPU idle':>18s} {'GPU busy':>18s}")
    rows = {"map": "none", "map + zero, waited": "waited", "map + zero, queued": "queued"}
    idle = {name: pool.round(args.pages, zero) for name, zero in rows.items()}
    with _busy_gpu():
        busy = {name: pool.round(args.pages, zero) for name, zero in rows.items()}
    for name in rows:
        cells = [f"{wall:6.2f} (cpu {cpu:5.2f})" for wall, cpu in (idle[name], busy[name])]
        print(f"{name:24s} {cells[0]:>18s} {cells[1]:>18s}")


if __name__ == "__main__":
    main()
