"""CUDA-only checks: real kernels on mapped pages, zero reads of unbacked pages, map/unmap under load, the
driver's memory accounting. Run by ci/gpu.sh on the GPU machine (`pytest -m gpu`); skipped elsewhere."""

from __future__ import annotations

import threading

import pytest
import torch
from dataplane_helpers import MiB, make_rig
from elastic_kv import _vmm
from elastic_kv.errors import StateConsistencyError

pytestmark = pytest.mark.gpu

GiB = 1 << 30


@pytest.fixture
def cuda() -> _vmm.CudaBackend:
    return _vmm.CudaBackend(0)


def test_kernels_read_and_write_mapped_pages(cuda: _vmm.CudaBackend) -> None:
    rig = make_rig(cuda, num_pages=8)
    rig.group.map([1, 2, 5])
    floats = rig.views[0].view(torch.float32)
    per_page = 2 * MiB // 4
    src = floats[1 * per_page : 2 * per_page]
    src.copy_(torch.arange(per_page, device="cuda", dtype=torch.float32))
    dst = floats[5 * per_page : 6 * per_page]
    torch.mul(src, 2.0, out=dst)
    dst.add_(1.0)
    expected = torch.arange(per_page, dtype=torch.float32) * 2 + 1
    assert torch.equal(dst.cpu(), expected)
    # A strided view across two mapped pages, as an attention kernel would read a block table.
    pair = floats.as_strided((2, 16), (per_page, 1), storage_offset=1 * per_page)
    assert torch.equal(pair[0].cpu(), torch.arange(16, dtype=torch.float32))
    torch.cuda.synchronize()
    rig.close()


def test_unbacked_pages_read_zeros_in_kernels(cuda: _vmm.CudaBackend) -> None:
    rig = make_rig(cuda, num_pages=8)
    rig.group.map([3])
    rig.views[0][3 * 2 * MiB : 4 * 2 * MiB].fill_(7)
    halves = rig.views[0].view(torch.float16)
    # Gather rows from backed and unbacked pages (padding indices point into unbacked pages).
    rows = halves.view(-1, 1024)
    index = torch.tensor([0, 3 * 1024, 6 * 1024 + 5, 7 * 1024 + 1023], device="cuda")
    picked = rows.index_select(0, index).float().sum(dim=1).cpu()
    assert picked[0] == 0 and picked[2] == 0 and picked[3] == 0 and picked[1] != 0
    assert int(rig.views[0][: 3 * 2 * MiB].count_nonzero()) == 0
    torch.cuda.synchronize()
    rig.close()


def test_map_and_unmap_while_kernels_run_on_other_pages(cuda: _vmm.CudaBackend) -> None:
    """Kernels keep updating pages 0-3 on a side stream while another thread maps and unmaps pages 8-63."""
    rig = make_rig(cuda, num_pages=64, max_cached_bytes=16 * MiB)
    rig.group.map([0, 1, 2, 3])
    work = rig.views[0][: 4 * 2 * MiB].view(torch.float32)
    work.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for round_ in range(40):
                pages = list(range(8 + (round_ % 4), 64, 4))
                rig.group.map(pages)
                rig.group.unmap(pages)
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    iterations = 0
    with torch.cuda.stream(stream):
        thread = threading.Thread(target=churn)
        thread.start()
        while not stop.is_set():
            work.add_(1.0)
            iterations += 1
        thread.join()
    stream.synchronize()
    assert errors == []
    assert iterations > 0 and torch.all(work == float(iterations)).item()
    rig.group.map([8])
    rig.write_page(8)
    assert rig.holds_last_write(8)
    rig.close()


def test_driver_memory_follows_map_and_unmap(cuda: _vmm.CudaBackend) -> None:
    """What the driver reports free moves by what we map and release (memory really comes and goes)."""
    pages = GiB // (2 * MiB)
    rig = make_rig(cuda, num_pages=pages, max_cached_bytes=0)
    torch.cuda.synchronize()
    free_before, _ = cuda.mem_info()
    rig.group.map(list(range(pages)))
    free_mapped, _ = cuda.mem_info()
    rig.group.unmap(list(range(pages)))
    free_after, _ = cuda.mem_info()
    assert free_before - free_mapped >= GiB - 64 * MiB
    assert abs(free_after - free_before) <= 64 * MiB
    rig.close()


@pytest.mark.parametrize("page_mib", [32, 64])
def test_large_pages(cuda: _vmm.CudaBackend, page_mib: int) -> None:
    page = page_mib * MiB
    rig = make_rig(cuda, num_pages=8, page_size=page)
    rig.group.map([0, 7])
    rig.write_page(0)
    rig.write_page(7)
    assert rig.holds_last_write(0) and rig.holds_last_write(7) and rig.page_zero(3)
    rig.close()


def test_rollback_on_cuda_with_injected_failures(cuda: _vmm.CudaBackend) -> None:
    fault = _vmm.FaultInjectingBackend(cuda)
    rig = make_rig(fault, num_pages=8, extents=[(0, 0, 3 * MiB, 3 * MiB)])
    rig.group.map([0])
    rig.write_page(0)
    for op in ("create", "map", "set_access", "unmap"):
        fault.fail(op, nth=2, error="oom" if op in ("create", "map") else "error")
        try:
            rig.group.map([1, 2, 3])
            rig.group.unmap([1, 2, 3])
        except (_vmm.BackendError, MemoryError):
            pass  # rolled back: whatever failed left the state as it was before that call
        fault.clear()
        assert rig.group.consistent and rig.holds_last_write(0)
        assert rig.zero_slots_read_zero()
        mapped = [p for p in (1, 2, 3) if rig.group.is_mapped(p)]
        assert mapped in ([], [1, 2, 3])  # all or nothing
        rig.group.unmap(mapped)
    fault.fail("map", nth=1, times=-1, error="error")  # the rollback fails too: quarantine, not a crash
    with pytest.raises(StateConsistencyError):
        rig.group.map([4, 5])
    fault.clear()
    assert rig.holds_last_write(0)  # the rest of the pool stays readable
    rig.close()
