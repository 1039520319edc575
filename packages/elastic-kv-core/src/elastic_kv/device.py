"""One name per physical device, the same in every engine, rank and process: :func:`device_key`.

Pools share a device's budget when their records name the same device, so the name must depend on the
hardware only -- not on the engine, on ``CUDA_VISIBLE_DEVICES``, or on which rank asks:

* the host backend (real host memory) is always :data:`HOST_DEVICE` (``"cpu"``): one budget per host;
* a CUDA GPU is its UUID as the driver reports it (``cuDeviceGetUuid``), written like ``nvidia-smi -L``
  does (``GPU-8a3b...``), so ``kvctl budget GPU-... 60G`` names the GPU the operator sees; a MIG instance
  has its own UUID, and its own memory, hence its own budget;
* a ROCm GPU is its UUID from HIP (``hipDeviceGetUuid``), ``GPU-`` and the 16 bytes in hex.

``index`` is the device's ordinal *as this process sees it* (after ``CUDA_VISIBLE_DEVICES``): what
``torch.device("cuda", index)`` means here. The driver is asked through ``ctypes`` without creating a
context, so a process that never touches the GPU (vLLM's engine core) may call it without taking GPU
memory. Where the driver cannot answer, the key falls back to ``"<kind>:<index>"`` with a warning: the
pool still works, but it shares a budget only with pools that fell back the same way.

:func:`device_total_bytes` reports the device's memory size the same way (host: physical RAM), so that
every pool records it and ``kvctl`` percentages work whichever engine started first.
:func:`device_free_bytes` reads a device's free memory by its key (NVML for a CUDA GPU, also without a
context: what every process on the GPU left free; the host's available memory for ``cpu``), for a ledger
that runs where no device context exists (vLLM's scheduler) and must still keep ``min_free_bytes`` free.

Headroom. :func:`default_min_free_bytes` is the ``ELASTIC_KV_MIN_FREE`` the plugins use on GPUs when the
user sets none: KV growth stops while the device has less than that free, so that what the engines
allocate *outside* their KV cache during a burst -- activations and sampler buffers beyond what start-up
profiling kept cached, cuBLAS/attention workspaces, a CUDA graph replay's pool, NCCL buffers -- finds
memory instead of failing. It is ``max(1 GiB, 1% of the device)``: for an 8B model at 8192 batched tokens
the largest transient tensors (the MLP's 8192 x 14336 bf16 intermediate, the logits of 256 sequences over
a 128k vocabulary in fp32) are about 0.25 GiB each, and two engines bursting together must both fit. It
is an estimate until measured; ``ci/gpu_headroom.py`` measures what a vLLM engine allocates beyond its KV
during a burst on the GPU machine.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Literal

__all__ = [
    "HOST_DEVICE",
    "DeviceKind",
    "default_min_free_bytes",
    "device_free_bytes",
    "device_key",
    "device_total_bytes",
]

logger = logging.getLogger(__name__)

HOST_DEVICE = "cpu"
DeviceKind = Literal["cpu", "cuda", "hip"]

_LIBRARIES = {"cuda": "libcuda.so.1", "hip": "libamdhip64.so"}


class _Driver:
    """The few driver entry points the key and the size need, loaded once per kind."""

    def __init__(self, kind: Literal["cuda", "hip"]) -> None:
        self.kind = kind
        lib = ctypes.CDLL(_LIBRARIES[kind])
        if kind == "cuda":
            self._check(lib.cuInit(0), "cuInit")
            self._get = lib.cuDeviceGet
            self._uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
            self._total = lib.cuDeviceTotalMem_v2
        else:
            self._check(lib.hipInit(0), "hipInit")
            self._get = lib.hipDeviceGet
            self._uuid = lib.hipDeviceGetUuid
            self._total = lib.hipDeviceTotalMem

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            raise OSError(f"{call} failed with status {status}")

    def _device(self, index: int) -> ctypes.c_int:
        device = ctypes.c_int()
        self._check(self._get(ctypes.byref(device), index), f"device {index}")
        return device

    def uuid(self, index: int) -> bytes:
        raw = (ctypes.c_ubyte * 16)()
        self._check(self._uuid(raw, self._device(index)), "device UUID")
        return bytes(raw)

    def total_bytes(self, index: int) -> int:
        size = ctypes.c_size_t()
        self._check(self._total(ctypes.byref(size), self._device(index)), "device memory size")
        return int(size.value)


@functools.cache
def _driver(kind: Literal["cuda", "hip"]) -> _Driver:
    return _Driver(kind)


def _format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@functools.cache
def device_key(kind: DeviceKind, index: int = 0) -> str:
    """The registry name of device ``index`` of ``kind`` as this process sees it (module docstring).

    ``ValueError`` for an unknown kind or a negative index.
    """
    if kind == "cpu":
        return HOST_DEVICE
    if kind not in _LIBRARIES:
        raise ValueError(f"unknown device kind {kind!r}; expected cpu, cuda or hip")
    if index < 0:
        raise ValueError(f"device index must be >= 0, got {index}")
    try:
        return _format_uuid(_driver(kind).uuid(index))
    except (OSError, AttributeError) as exc:
        fallback = f"{kind}:{index}"
        logger.warning(
            "cannot read the UUID of %s device %d (%s); its pools use the device name %r, which pools "
            "started with another CUDA_VISIBLE_DEVICES would not share",
            kind,
            index,
            exc,
            fallback,
        )
        return fallback


@functools.cache
def device_total_bytes(kind: DeviceKind, index: int = 0) -> int:
    """The memory size of the device (host: physical RAM); 0 where the driver cannot say."""
    if kind == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        return _driver(kind).total_bytes(index)
    except (OSError, AttributeError):
        return 0


def default_min_free_bytes(total_bytes: int) -> int:
    """The headroom kept free on a GPU of ``total_bytes`` when the user sets no ``ELASTIC_KV_MIN_FREE``
    (see the module docstring): ``max(1 GiB, 1% of the device)``."""
    return max(1 << 30, total_bytes // 100)


class _Nvml:
    """NVML's free-memory reading of a GPU by UUID (no CUDA context)."""

    class _Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self._lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        self._handles: dict[str, ctypes.c_void_p] = {}

    def free(self, key: str) -> int:
        handle = self._handles.get(key)
        if handle is None:
            handle = ctypes.c_void_p()
            if self._lib.nvmlDeviceGetHandleByUUID(key.encode(), ctypes.byref(handle)) != 0:
                raise OSError(f"NVML does not know {key}")
            self._handles[key] = handle
        memory = self._Memory()
        if self._lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            raise OSError(f"nvmlDeviceGetMemoryInfo({key}) failed")
        return int(memory.free)


@functools.cache
def _nvml() -> _Nvml:
    return _Nvml()


def device_free_bytes(key: str) -> int | None:
    """Free memory of the device named ``key`` (:func:`device_key`) now; ``None`` if it cannot be read
    (not a CUDA GPU UUID, no NVML). A few tens of microseconds: call it at most once per engine step."""
    if key == HOST_DEVICE:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if not key.startswith("GPU-"):
        return None
    try:
        return _nvml().free(key)
    except (OSError, AttributeError):
        return None
