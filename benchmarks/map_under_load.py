"""What mapping and zeroing a logical page costs on a GPU: the vLLM worker's rank, and the engine beside it.

A pool shaped like vLLM 0.26's for Llama-3-8B (``--layers`` spaces, one slot of ``--slot-mib`` per layer and
page) maps ``--pages`` pages one at a time, as the plugin's background jobs do. Three tables:

1. The rank's milliseconds per page (median), with the GPU idle and with another thread keeping it busy with
   large matmuls (a prefill's stand-in); driver calls run on the calling thread, so wall and thread-CPU
   time are both printed:

   * ``map``: ``SpaceGroup.map`` alone (per layer: unmap the zero page, create or reuse a handle, map, set
     access);
   * ``map + zero, waited``: then a ``zero_`` per slot on a side stream, synchronized (what the worker
     did before it ordered the engine's next step after the memsets instead);
   * ``map + zero, queued``: the same memsets queued, not waited for.

2. The GPU time of one page's memsets, per way of launching them: a ``zero_`` per slot, the same on the
   slots viewed as int64, one ``torch._foreach_zero_`` for all of them (what the worker does now), a
   ``cuMemsetD32Async`` per slot.

3. What the rank's work costs an engine thread in the same process, as vLLM's worker has: a stand-in
   engine runs steps (``--launches`` small kernels launched from Python, ``--matmuls`` matmuls, a read
   back, and a ``wait_event`` on the latest memsets, as ``order_step`` does) while the rank maps pages back
   to back in each mode; the table gives its step time against no rank activity.

    python benchmarks/map_under_load.py [--layers 32] [--slot-mib 8] [--pages 52] [--pooled]
                                        [--steps 400] [--launches 200] [--matmuls 8]

The H200's numbers are in ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import statistics
import threading
import time
from collections.abc import Iterator

import torch
from elastic_kv import _vmm

MiB = 1 << 20


def _driver_memset(views: list[torch.Tensor], stream: torch.cuda.Stream) -> None:
    for view in views:
        _check(_libcuda().cuMemsetD32Async(view.data_ptr(), 0, view.numel() // 4, stream.cuda_stream))


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p]
    return lib


def _check(result: int) -> None:
    if result != 0:
        raise RuntimeError(f"cuMemsetD32Async: CUresult {result}")


def _loop(views: list[torch.Tensor], stream: torch.cuda.Stream) -> None:
    for view in views:
        view.zero_()


def _int64(views: list[torch.Tensor], stream: torch.cuda.Stream) -> None:
    for view in views:
        view.view(torch.int64).zero_()


# How a page's slots are zeroed, by mode: torch's zero_ per slot (waited for or queued), the same on the
# slots viewed as int64, one _foreach_zero_ for all (the plugin), the driver's cuMemsetD32Async per slot.
_ZEROES = {
    "waited": _loop,
    "queued": _loop,
    "int64": _int64,
    "foreach": lambda views, stream: torch._foreach_zero_(views),
    "driver": _driver_memset,
}
# The rank's rows: map alone, map and zero_ per slot waited for, the same queued.
_ROWS = {"map": "none", "map + zero, waited": "waited", "map + zero, queued": "queued"}
_METHODS = {
    "zero_ per slot": "queued",
    "zero_ per slot, int64": "int64",
    "one _foreach_zero_": "foreach",
    "cuMemsetD32Async per slot": "driver",
}


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
        self.zeroed = torch.cuda.Event()

    def map(self, page: int, zero: str) -> None:
        self.group.map([page])
        if zero == "none":
            return
        with torch.cuda.stream(self.stream):
            views = [flat[page * self.slot : (page + 1) * self.slot] for flat in self.flats]
            _ZEROES[zero](views, self.stream)
            self.zeroed.record(self.stream)
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


class _Engine:
    """A stand-in for vLLM's engine thread, in the rank's process as in vLLM's worker: each step makes its
    stream wait for the latest memsets (the worker's ``order_step``), launches ``launches`` small kernels
    from Python (input preparation), ``matmuls`` 4096^2 matmuls (the forward) and reads a result back (the
    sampled tokens)."""

    def __init__(self, launches: int, matmuls: int) -> None:
        self.launches = launches
        self.matmuls = matmuls
        self.x = torch.zeros(4096, device="cuda")
        self.idx = torch.arange(0, 4096, 2, device="cuda")
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step(self, zeroed: torch.cuda.Event | None) -> None:
        if zeroed is not None:
            torch.cuda.current_stream().wait_event(zeroed)
        for _ in range(self.launches // 2):
            y = self.x[self.idx]
            self.x[: y.numel()].add_(y)
        for _ in range(self.matmuls):
            torch.mm(self.a, self.a)
        self.x[:8].tolist()

    def steps(self, n: int, zeroed: torch.cuda.Event | None) -> tuple[float, float]:
        """Mean wall and thread-CPU ms per step over ``n`` steps (after 20 unmeasured ones)."""
        for _ in range(20):
            self.step(None)
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(n):
            self.step(zeroed)
        return 1e3 * (time.perf_counter() - t) / n, 1e3 * (time.thread_time() - c) / n


def _memset_time(pool: _Pool) -> None:
    """GPU time of one page's memsets, GPU otherwise idle, per way of zeroing (median of 20)."""
    pool.group.map([0])
    views = [flat[: pool.slot] for flat in pool.flats]
    print("\nGPU time to zero one page (ms, GPU otherwise idle)")
    for name, zero in _METHODS.items():
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(pool.stream):
                start.record(pool.stream)
                _ZEROES[zero](views, pool.stream)
                end.record(pool.stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        print(f"  {name:28s} {statistics.median(times):7.3f}")
    pool.group.unmap([0])


def _map_rounds(pool: _Pool, pages: int, zero: str, stop: threading.Event, mapped: list[int]) -> None:
    """Map ``pages`` pages one at a time, wait for their memsets, unmap them; again until ``stop``."""
    while not stop.is_set():
        for page in range(pages):
            pool.map(page, zero)
            mapped[0] += 1
            if stop.is_set():
                break
        pool.stream.synchronize()
        pool.group.unmap([p for p in range(pages) if pool.group.is_mapped(p)])


def _engine_cost(pool: _Pool, pages: int, steps: int, launches: int, matmuls: int) -> None:
    """The engine's step time while the rank maps pages in each mode, against no rank activity."""
    engine = _Engine(launches, matmuls)
    print(f"\nengine steps ({launches} small launches + {matmuls} matmuls + a read-back) while the rank maps")
    print(f"{'rank':24s} {'ms/step':>8s} {'cpu ms':>7s} {'vs idle':>8s} {'pages':>6s}")
    base = None
    extra = {f"map + zero, {zero}": zero for zero in ("int64", "foreach", "driver")}
    for name, zero in (("idle", None), *_ROWS.items(), *extra.items()):
        stop, mapped = threading.Event(), [0]
        thread = None
        if zero is not None:
            thread = threading.Thread(target=_map_rounds, args=(pool, pages, zero, stop, mapped), daemon=True)
            thread.start()
        wall, cpu = engine.steps(steps, pool.zeroed if zero not in (None, "none", "waited") else None)
        stop.set()
        if thread is not None:
            thread.join()
        base = base or wall
        print(f"{name:24s} {wall:8.3f} {cpu:7.3f} {wall / base:8.3f} {mapped[0]:6d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--slot-mib", type=int, default=8)
    parser.add_argument("--pages", type=int, default=52, help="pages mapped per round (a burst's growth)")
    parser.add_argument("--pooled", action="store_true", help="reuse handles between rounds")
    parser.add_argument("--steps", type=int, default=400, help="engine steps per row of the engine table")
    parser.add_argument("--launches", type=int, default=200, help="small kernels an engine step launches")
    parser.add_argument("--matmuls", type=int, default=8, help="4096^2 bf16 matmuls an engine step runs")
    args = parser.parse_args()
    pool = _Pool(args.layers, args.slot_mib * MiB, args.pages, args.pooled)
    pool.round(args.pages, "waited")  # warm-up: first kernels, the handle pool
    print(f"{args.layers} layers x {args.slot_mib} MiB slots, {args.pages} pages a round, ms per page")
    print(f"{'':24s} {'GPU idle':>18s} {'GPU busy':>18s}")
    idle = {name: pool.round(args.pages, zero) for name, zero in _ROWS.items()}
    with _busy_gpu():
        busy = {name: pool.round(args.pages, zero) for name, zero in _ROWS.items()}
    for name in _ROWS:
        cells = [f"{wall:6.2f} (cpu {cpu:5.2f})" for wall, cpu in (idle[name], busy[name])]
        print(f"{name:24s} {cells[0]:>18s} {cells[1]:>18s}")
    _memset_time(pool)
    _engine_cost(pool, args.pages, args.steps, args.launches, args.matmuls)


if __name__ == "__main__":
    main()
