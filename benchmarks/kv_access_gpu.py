"""Do kernels read KV blocks from elastic memory as fast as from the caching allocator's? (GPU, not a test.)

Same-run comparison of one access pattern over three buffers of equal size: ``torch.empty`` (cudaMalloc
through PyTorch's caching allocator, what vLLM's native KV cache is) and an elastic space fully mapped
through ``elastic_kv._vmm`` with 2 MiB handles, or with one handle per 32 MiB logical page (the compound
pages ``ELASTIC_KV_PAGE_SIZE=32M`` gives). Two patterns:

* ``gather``: paged-attention-like reads -- ``--batch`` sequences x ``--blocks`` random KV blocks of
  ``--block-kib`` KiB each, anywhere in the buffer (TLB reach matters here);
* ``stream``: one sequential pass summing the whole buffer (bandwidth).

Rounds alternate the buffers (native, elastic 2 MiB, elastic 32 MiB, native, ...) and each time is the
median over rounds of a CUDA-event-timed loop; the ratios are elastic / native (1.00 = no difference).

    python benchmarks/kv_access_gpu.py [--gib 4] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from elastic_kv import _vmm

MiB = 1 << 20
GiB = 1 << 30


def elastic_buffer(backend: _vmm.Backend, nbytes: int, page: int) -> tuple[torch.Tensor, object]:
    """A byte tensor over a fully mapped space (2 MiB slots; one handle per ``page`` bytes)."""
    slot = backend.granularity
    space = _vmm.TensorSpace(backend, nbytes, slot)
    pool = _vmm.HandlePool(backend, 0)
    group = _vmm.SpaceGroup([space], [(0, 0, page, page)], nbytes // page, pool)
    group.map(list(range(nbytes // page)))
    return torch.from_dlpack(space), (space, pool, group)  # keep the owners alive


def timed(fn: Callable[[], object], iters: int) -> float:
    """Microseconds per call of ``fn``, CUDA-event timed after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="buffer size")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--block-kib", type=int, default=32)
    args = parser.parse_args()

    backend = _vmm.CudaBackend(0)
    nbytes = int(args.gib * GiB) // (32 * MiB) * (32 * MiB)
    block = args.block_kib * 1024 // 2  # bf16 elements per block
    buffers: dict[str, torch.Tensor] = {"native": torch.empty(nbytes, dtype=torch.uint8, device="cuda")}
    owners: list[object] = []
    for name, page in (("elastic-2M", 2 * MiB), ("elastic-32M", 32 * MiB)):
        buffers[name], owner = elastic_buffer(backend, nbytes, page)
        owners.append(owner)
    views = {name: t.view(torch.bfloat16).view(-1, block) for name, t in buffers.items()}
    for v in views.values():
        v.normal_()
    nblocks = next(iter(views.values())).shape[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, nblocks, (args.batch * args.blocks,), device="cuda", generator=gen)
    out = torch.empty(idx.numel(), block, dtype=torch.bfloat16, device="cuda")

    times: dict[str, dict[str, list[float]]] = {"gather": {}, "stream": {}}
    for _ in range(args.rounds):
        for name, v in views.items():
            times["gather"].setdefault(name, []).append(
                timed(lambda v=v: torch.index_select(v, 0, idx, out=out), args.iters)
            )
            times["stream"].setdefault(name, []).append(timed(lambda v=v: v.sum(dtype=torch.float32), 5))
    result: dict[str, object] = {"gib": nbytes / GiB, "device": torch.cuda.get_device_name(0)}
    for pattern, per in times.items():
        med = {name: statistics.median(ts) for name, ts in per.items()}
        result[pattern] = {
            "us": {k: round(x, 2) for k, x in med.items()},
            "ratio": {k: round(med[k] / med["native"], 4) for k in med if k != "native"},
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
