"""CudaBackend and HipBackend against a fake driver library built by this test (fake_driver/).

The fake emulates the drivers' virtual-memory rules on host memory (see fake_gpu_driver.cpp), so these tests
exercise the backends' real code paths -- dlopen, cuGetProcAddress with the 12.0 ABI, context push/pop,
error-code mapping, zero-filling device memory -- in CI. They say nothing about real hardware: the CUDA
backend is tested on the H200 by test_gpu_*.py (ci/gpu.sh); the HIP backend has never run on an AMD GPU.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dataplane_helpers import MiB, Rig, expected_live_handles, make_rig
from elastic_kv import _vmm
from elastic_kv.errors import ConfigError, PoolExhausted

SOURCE = Path(__file__).parent / "fake_driver" / "fake_gpu_driver.cpp"
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_FOUND = 500


@pytest.fixture(scope="session")
def fake_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.fail("a C++ compiler is needed to build the fake driver (the extension needs one too)")
    out = tmp_path_factory.mktemp("fake_driver") / "libfakegpu.so"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(out), str(SOURCE)], check=True
    )
    return out


@pytest.fixture
def fake(fake_library: Path) -> Iterator[ctypes.CDLL]:
    """The fake driver, reset to one VMM-capable device with 2 MiB granularity; checked for leaks after."""
    lib = ctypes.CDLL(str(fake_library))  # the same instance the backend dlopens (same path)
    lib.fake_configure(1, 1, 1, ctypes.c_size_t(2 * MiB), ctypes.c_size_t(0))
    lib.fake_calls.restype = ctypes.c_long
    lib.fake_calls.argtypes = [ctypes.c_char_p]
    lib.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_int]
    yield lib
    assert lib.fake_live_handles() == 0, "the backend leaked driver handles"
    assert lib.fake_live_mappings() == 0 and lib.fake_live_reservations() == 0


def host_view(space: _vmm.TensorSpace) -> torch.Tensor:
    """A CPU tensor over the fake's "device" memory (which is host memory)."""
    return torch.frombuffer((ctypes.c_ubyte * space.size).from_address(space.base), dtype=torch.uint8)


def _behaviour(backend: _vmm.Backend, fake: ctypes.CDLL) -> None:
    """Map/unmap/compound/shared slots/transactions through the backend, data checked in memory."""
    rig: Rig = make_rig(
        backend, num_pages=4, extents=[(0, 0, 4 * MiB, 4 * MiB), (1, 0, 3 * MiB, 3 * MiB)], view=host_view
    )
    baseline = backend.live_handles
    assert fake.fake_live_handles() == baseline  # zero pages: 2 MiB and 4 MiB
    assert rig.zero_slots_read_zero()  # the zero pages were zero-filled on the "device"
    rig.group.map([0, 1, 2])
    for p in (0, 1, 2):
        rig.write_page(p)
    rig.group.prepare(1, [1])
    assert rig.group.page_state(1) == "prepared"
    rig.group.abort(1)
    rig.group.unmap([0])
    assert rig.holds_last_write(1) and rig.holds_last_write(2)
    # Space 0: pages 1, 2 = slots 2-5 (two compound units); space 1: 3 MiB pages 1, 2 = slots 1-4.
    assert rig.slot_states() == [
        ["zero"] * 2 + ["mapped"] * 4 + ["zero"] * 2,
        ["zero"] + ["mapped"] * 4 + ["zero"],
    ]
    assert backend.live_handles == expected_live_handles(rig, baseline) == fake.fake_live_handles()
    rig.close()
    del rig


def test_cuda_backend_resolves_entry_points_with_the_12_0_abi(fake: ctypes.CDLL, fake_library: Path) -> None:
    backend = _vmm.CudaBackend(0, library=str(fake_library))
    assert (backend.name, backend.device, backend.granularity) == ("cuda", ("cuda", 0), 2 * MiB)
    assert backend.driver_version == 12080 and fake.fake_last_requested_version() == 12000
    assert backend.multi_unmap  # probed: the fake accepts one unmap over adjacent mappings
    assert backend.calls("create") == 0  # the probe bypasses the counters
    free, total = backend.mem_info()
    assert 0 < free <= total
    backend.synchronize()
    fake.fake_configure(1, 1, 0, ctypes.c_size_t(2 * MiB), ctypes.c_size_t(0))
    assert not _vmm.CudaBackend(0, library=str(fake_library)).multi_unmap  # probe says no
    assert _vmm.CudaBackend(0, library=str(fake_library), multi_unmap=False).multi_unmap is False


def test_cuda_configuration_errors(fake: ctypes.CDLL, fake_library: Path) -> None:
    lib = str(fake_library)
    with pytest.raises(ConfigError, match="cuDeviceGet"):
        _vmm.CudaBackend(3, library=lib)
    fake.fake_configure(1, 0, 1, ctypes.c_size_t(2 * MiB), ctypes.c_size_t(0))
    with pytest.raises(ConfigError, match="does not support virtual memory management"):
        _vmm.CudaBackend(0, library=lib)
    fake.fake_configure(0, 1, 1, ctypes.c_size_t(2 * MiB), ctypes.c_size_t(0))
    with pytest.raises(ConfigError, match=r"cuInit.*CUDA_ERROR_NO_DEVICE"):
        _vmm.CudaBackend(0, library=lib)
    fake.fake_configure(1, 1, 1, ctypes.c_size_t(2 * MiB), ctypes.c_size_t(0))
    fake.fake_fail(b"cuMemsetD8", 1, CUDA_ERROR_NOT_FOUND)  # an old driver without the entry point
    with pytest.raises(ConfigError, match="does not provide cuMemsetD8"):
        _vmm.CudaBackend(0, library=lib)


def test_cuda_behaviour_on_the_fake_driver(fake: ctypes.CDLL, fake_library: Path) -> None:
    backend = _vmm.CudaBackend(0, library=str(fake_library))
    _behaviour(backend, fake)
    assert fake.fake_calls(b"cuMemsetD8") >= 2  # one zero fill per zero page size


@pytest.mark.parametrize("multi_unmap", [True, False])
def test_cuda_errors_map_to_typed_exceptions_with_rollback(
    fake: ctypes.CDLL, fake_library: Path, multi_unmap: bool
) -> None:
    backend = _vmm.CudaBackend(0, library=str(fake_library), multi_unmap=multi_unmap)
    rig = make_rig(backend, num_pages=8, max_cached_bytes=0, view=host_view)
    baseline = backend.live_handles
    rig.group.map([0])
    rig.write_page(0)
    fake.fake_fail(b"cuMemMap", 2, CUDA_ERROR_OUT_OF_MEMORY)  # cuMemMap can run out of memory too
    with pytest.raises(PoolExhausted, match="cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY"):
        rig.group.map([1, 2, 3])
    fake.fake_fail(b"cuMemSetAccess", 1, CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(_vmm.BackendError, match="cuMemSetAccess failed: CUDA_ERROR_INVALID_VALUE"):
        rig.group.map([4])
    fake.fake_fail(b"cuMemUnmap", 1, CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(_vmm.BackendError, match="cuMemUnmap"):
        rig.group.unmap([0])
    assert rig.group.consistent and rig.group.mapped_pages() == [0] and rig.holds_last_write(0)
    assert backend.live_handles == expected_live_handles(rig, baseline) == fake.fake_live_handles()
    fake.fake_configure(
        1, 1, 1, ctypes.c_size_t(2 * MiB), ctypes.c_size_t(fake.fake_live_handles() * 2 * MiB)
    )
    with pytest.raises(PoolExhausted, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        rig.group.map([5])
    rig.close()


def test_cuda_context_is_pushed_for_each_call_and_restored(fake: ctypes.CDLL, fake_library: Path) -> None:
    backend = _vmm.CudaBackend(0, library=str(fake_library))
    fake.fake_push_foreign_context()  # e.g. torch left another device's context current on this thread
    try:
        rig = make_rig(backend, num_pages=4, view=host_view)  # every call needs the primary context
        rig.group.map([0])
        assert fake.fake_current_is_foreign()  # popped again afterwards
        rig.group.map_async([1, 2])  # the worker thread has no context at all
        assert rig.group.collect(wait=True)[0][2] is None
        rig.close()
        del rig
    finally:
        fake.fake_pop_context()


def test_hip_backend_on_the_fake_runtime(fake: ctypes.CDLL, fake_library: Path) -> None:
    backend = _vmm.HipBackend(0, library=str(fake_library))
    assert (backend.name, backend.device, backend.granularity, backend.multi_unmap) == (
        "hip",
        ("rocm", 0),
        2 * MiB,
        False,
    )
    _behaviour(backend, fake)
    assert fake.fake_calls(b"hipMemsetD8") >= 2
    space = _vmm.TensorSpace(backend, 2 * MiB, 2 * MiB)
    assert space.__dlpack_device__() == (10, 0)  # kDLROCM
    del space


def test_hip_errors_and_device_scope(fake: ctypes.CDLL, fake_library: Path) -> None:
    lib = str(fake_library)
    fake.fake_configure(2, 1, 1, ctypes.c_size_t(2 * MiB), ctypes.c_size_t(0))
    backend = _vmm.HipBackend(0, library=lib)
    fake.hipSetDevice(1)  # the caller works on device 1
    backend.mem_info()  # runs on device 0 ...
    current = ctypes.c_int(-1)
    fake.hipGetDevice(ctypes.byref(current))
    assert current.value == 1  # ... and gives device 1 back
    rig = make_rig(backend, num_pages=4, max_cached_bytes=0, view=host_view)
    fake.fake_fail(b"hipMemMap", 1, 2)  # hipErrorOutOfMemory
    with pytest.raises(PoolExhausted, match="hipMemMap failed: hipErrorOutOfMemory"):
        rig.group.map([0, 1])
    assert rig.group.consistent and rig.group.mapped_pages() == []
    rig.close()
    del rig
    with pytest.raises(ConfigError, match="does not exist"):
        _vmm.HipBackend(2, library=lib)
    fake.fake_configure(1, 0, 1, ctypes.c_size_t(2 * MiB), ctypes.c_size_t(0))
    with pytest.raises(ConfigError, match="does not support virtual memory management"):
        _vmm.HipBackend(0, library=lib)
