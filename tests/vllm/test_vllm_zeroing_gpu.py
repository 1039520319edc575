"""The worker's zeroing of newly mapped pages on a GPU (marker ``gpu``; run by ``ci/gpu.sh``).

``_ZeroingTarget.map`` queues the memsets on a stream of its own and returns without waiting for them;
``order_step`` orders the engine's stream after them, and an unmap waits for them on the host. Each test
holds the zeroing stream back with a sleeping kernel, so that a missing wait shows: the engine's stream
would read the bytes the reused handles still hold, or a memset would run after its page was unmapped
(an illegal address: the CUDA context dies and every later test fails).
"""

from __future__ import annotations

import time

import pytest
import torch
from elastic_kv import _vmm
from elastic_kv.geometry import BlockFamily, BlockGeometry
from vllm_elastic_kv.worker.worker_pool import _ZeroingTarget

pytestmark = pytest.mark.gpu

MIB = 1 << 20
PAGE = 2 * MIB
PAGES = 8
BLOCK = 256 << 10  # 8 blocks a page
HOLD_S = 0.2  # how long the sleeping kernel holds the zeroing stream back


def _target() -> tuple[_ZeroingTarget, torch.Tensor]:
    backend = _vmm.CudaBackend(0)
    space = _vmm.TensorSpace(backend, PAGES * PAGE, PAGE)
    geo = BlockGeometry([PAGES * PAGE], [BlockFamily(0, 0, BLOCK, BLOCK)], PAGES * PAGE // BLOCK, PAGE)
    pool = _vmm.HandlePool(backend, PAGES * PAGE)  # unmapped handles keep their bytes for the next map
    group = _vmm.SpaceGroup([space], geo.extent_tuples(), geo.num_pages, pool)
    flat = torch.from_dlpack(space)
    target = _ZeroingTarget(group, geo, [flat])
    pages = list(range(PAGES))
    target.map(pages)
    target.order_step()
    flat.fill_(7)
    torch.cuda.synchronize()
    target.unmap(pages)
    return target, flat


def _hold(target: _ZeroingTarget) -> None:
    """Queue a kernel that keeps the zeroing stream busy for about HOLD_S."""
    cycles = int(HOLD_S * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    with torch.cuda.stream(target._stream):
        torch.cuda._sleep(cycles)


def test_map_returns_before_the_memsets_and_the_next_step_reads_zeros() -> None:
    target, flat = _target()
    _hold(target)
    t0 = time.perf_counter()
    target.map(list(range(PAGES)))  # the pool's handles, still full of 7s
    took = time.perf_counter() - t0
    assert took < HOLD_S / 2, f"map waited {took:.3f} s for the zeroing"
    target.order_step()  # the engine, before its next step
    assert int(flat.count_nonzero()) == 0  # read on the current stream, after the held-back memsets
    target.close()


def test_order_step_is_needed_once_per_batch_of_maps() -> None:
    target, flat = _target()
    target.map([0])
    target.order_step()
    queued = target._queued
    target.order_step()  # nothing new: no second wait is queued
    assert target._ordered == queued
    _hold(target)
    target.map([1])
    target.order_step()
    assert target._ordered == queued + 1
    assert int(flat[: 2 * PAGE].count_nonzero()) == 0
    target.close()


@pytest.mark.parametrize("how", ["unmap", "prepare", "close"])
def test_unmapping_waits_for_queued_memsets(how: str) -> None:
    target, flat = _target()
    _hold(target)
    target.map([0, 1])
    assert target._zeroed is not None and not target._zeroed.query()  # the memsets still wait
    if how == "unmap":
        target.unmap([0, 1])
    elif how == "prepare":
        target.prepare(1, [0, 1])
        target.commit(1)
    else:
        target.close()
    assert target._zeroed.query()
    torch.cuda.synchronize()  # an illegal address from a late memset would raise here
    if how != "close":
        target.map([0])
        target.order_step()
        assert int(flat[:PAGE].count_nonzero()) == 0
        target.close()
