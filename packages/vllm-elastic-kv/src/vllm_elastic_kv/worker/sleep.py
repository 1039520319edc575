"""Sleep mode into the host arena: the ``elastic`` sleep-mode backend of vLLM.

vLLM's sleep mode (``--enable-sleep-mode``, ``POST /sleep?level=1``) copies every allocation of the weights
to *newly allocated* page-locked host memory and frees the GPU copy; ``/wake_up`` maps new GPU memory and
copies them back. Allocating page-locked memory is the slow part: 2.1 GiB/s on an H200 host, 6.4 s for
8B-model weights, against 0.27 s for the copy itself (51 GiB/s). And every engine that ever slept keeps what
torch's page-locked cache holds, so host memory grows with the number of models.

This backend (selected by the plugin when the engine runs with the elastic KV cache, sleep mode on and a
host arena configured: ``ELASTIC_KV_HOST_ARENA``, which ``elastic-kv serve`` sets) puts the level-1 copies in
one extent of the host arena (:class:`elastic_kv.host.HostArena`): memory that is already resident, shared
by all engines of the host and bounded by the operator's host budget. Only pinning is left to do, and this
process keeps its pins (:class:`PinnedArena`), so a sleep costs the copy and a wake-up the copy back.

What is vLLM's and what is ours. Ours: choosing the extent, pinning it, copying the allocations vLLM would
offload at level 1 (``VersionSupport.sleep_offload_tags``) into it. vLLM's: unmapping and releasing every
allocation (``CuMemAllocator.sleep`` with nothing left to offload), and on wake-up mapping them again and
copying back from the host tensors we leave in each allocation's ``cpu_backup_tensor``
(``CuMemAllocator.wake_up``). Level 2 (weights discarded), and a level-1 sleep the arena has no room for,
are vLLM's own ``cumem`` backend unchanged.

A sleep that keeps its requests (``park_kv``, as ``elastic-kv serve`` starts its engines: the scheduler then
leaves the running requests in place, :mod:`vllm_elastic_kv.worker.parking`) must keep the engine's
per-request state too. vLLM keeps it at every level from 0.32 (the "runtime" pool); on 0.26 it sits in the
"kv_cache" pool, which a sleep discards, so this backend copies that pool's allocations to the host as well
(``VersionSupport.sleep_state_tags``), at every level, whether or not the arena has room for the weights.

Demotion (:meth:`ElasticSleepBackend.demote`, the worker's ``elastic_kv_demote``): an engine asleep at level 1
gives its extent back and becomes asleep at level 2, as if it had slept at level 2 in the first place. vLLM's
level-2 sleep keeps host copies of the model's buffers (which ``reload_weights`` does not restore); the
demotion takes those copies from the extent instead of the device, where the weights no longer are. It lets
``elastic-kv serve`` keep the arena for the models used most recently: a model going to sleep may take the
extent of one that has been asleep, and unused, for longer.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from elastic_kv.config import ElasticConfig
from elastic_kv.errors import ConfigError
from elastic_kv.host import Extent, HostArena
from elastic_kv.sizes import format_bytes
from vllm.device_allocator.sleep_mode_backend import CuMemBackend

from vllm_elastic_kv import compat

__all__ = [
    "ElasticSleepBackend",
    "PinnedArena",
    "host_copies",
    "level_one_bytes",
    "process_arena",
    "set_owner",
]

logger = logging.getLogger(__name__)


class PinnedArena:
    """The host arena as this process uses it: mapped once, its ranges page-locked for the GPU's copy engines
    (``cudaHostRegister``) and kept page-locked across sleeps, so the next sleep into the same range costs no
    pinning. Registered ranges never overlap (CUDA refuses that): taking a range that overlaps a registered
    one unregisters that one first."""

    def __init__(self, arena: HostArena) -> None:
        self.arena = arena
        self._pinned: list[tuple[int, int]] = []  # (address, size), disjoint
        self._lock = threading.Lock()

    def pin(self, address: int, size: int) -> float:
        """Page-lock ``[address, address + size)`` unless a registered range covers it; the seconds taken."""
        with self._lock:
            if any(a <= address and address + size <= a + n for a, n in self._pinned):
                return 0.0
            t0 = time.perf_counter()
            cudart = torch.cuda.cudart()
            for a, n in [r for r in self._pinned if r[0] < address + size and address < r[0] + r[1]]:
                _check(cudart.cudaHostUnregister(a), "cudaHostUnregister")
                self._pinned.remove((a, n))
            _check(cudart.cudaHostRegister(address, size, 0), "cudaHostRegister")
            self._pinned.append((address, size))
            return time.perf_counter() - t0

    def pin_extent(self, extent: Extent) -> float:
        """:meth:`pin` the bytes of ``extent``."""
        return self.pin(self.arena.address(extent), extent.size)

    def view(self, extent: Extent) -> torch.Tensor:
        """The bytes of ``extent`` as one flat ``uint8`` tensor over the arena's memory (no copy)."""
        return torch.frombuffer(self.arena.data(), dtype=torch.uint8, count=extent.size, offset=extent.offset)

    def pin_all(self) -> float:
        """:meth:`pin` the whole data region (about 14 GiB/s the first time in a process): every later sleep
        of this process then only copies."""
        whole = Extent(0, self.arena.size, 0, "")
        return self.pin(self.arena.address(whole), self.arena.size)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the arena page-locked in this process."""
        return sum(n for _, n in self._pinned)


def _check(result: Any, call: str) -> None:
    code = int(result)  # torch's cudart bindings return a cudaError enum
    if code != 0:
        raise RuntimeError(f"{call} failed with CUDA error {code}")


@functools.cache
def process_arena(path: Path) -> PinnedArena:
    """The one :class:`PinnedArena` of ``path`` in this process (page-locking is per process, so the pins
    belong to the process, not to one backend or worker object)."""
    return PinnedArena(HostArena.open(path))


_owner_name: str | None = None


def host_copies(
    tensors: Iterable[tuple[str, torch.Tensor]], backups: Mapping[int, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Host copies of the device ``tensors`` whose memory is asleep, read from the host copies of their
    allocations (``backups``: an allocation's device address -> the bytes it held, one ``uint8`` tensor).
    Each copy has its tensor's dtype, shape, strides and storage offset. A tensor outside every allocation
    is still on the device (its memory does not sleep) and has no entry."""
    spans = sorted((address, backup) for address, backup in backups.items())
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        for address, backup in spans:
            if address <= start and start + size <= address + backup.numel():
                raw = backup[start - address : start - address + size].clone()
                copy = torch.empty(0, dtype=tensor.dtype)
                copy.set_(raw.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
                out[name] = copy
                break
    return out


def _level_one_allocations(tags: Iterable[str]) -> tuple[Any, list[Any]]:
    """vLLM's allocator and the allocations under ``tags`` a level-1 sleep would copy to host memory now."""
    from vllm.device_allocator import get_mem_allocator_instance

    allocator: Any = get_mem_allocator_instance()  # CuMemAllocator on CUDA (checked next)
    compat.check_instance(allocator, "vllm.device_allocator.cumem.CuMemAllocator")
    allocations = allocator.pointer_to_data.values()
    return allocator, [d for d in allocations if d.tag in tags and not d.is_asleep]


def _sleep_tags(config: ElasticConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The allocation tags a level-1 sleep copies to the host on the installed vLLM, and those of the
    per-request state it copies as well (at every level) where ``park_kv`` keeps requests through it."""
    support = compat.support_for(compat.installed_version())
    return support.sleep_offload_tags, support.sleep_state_tags if config.park_kv else ()


def level_one_bytes() -> int:
    """Bytes of host memory a level-1 sleep of this process would take now (its weights, as it serves); 0
    where vLLM's sleep-mode allocator is not the ``CuMemAllocator`` this backend reads (where the plugin
    leaves sleeping to vLLM's own backend, and the size is known after the first sleep)."""
    offload, state = _sleep_tags(ElasticConfig.from_env(os.environ))
    try:
        return sum(d.handle[1] for d in _level_one_allocations((*offload, *state))[1])
    except (ConfigError, RuntimeError):  # not a CuMemAllocator; no sleep-mode allocator on this platform
        return 0


def set_owner(name: str | None) -> None:
    """Name this process's arena extents after the engine's pool (the worker calls it with the pool name of
    ``additional_config`` or ``ELASTIC_KV_POOL_NAME``, whichever configured it): ``elastic-kv status`` and
    the host budget attribute asleep weights to a model by it."""
    global _owner_name
    _owner_name = name


class ElasticSleepBackend(CuMemBackend):
    """vLLM's ``cumem`` sleep-mode backend, level-1 copies in the host arena (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        config = ElasticConfig.from_env(os.environ)
        self._arena = process_arena(config.host_arena) if config.host_arena is not None else None
        self._default_owner = config.pool_name or f"vllm-{os.getpid()}"
        self._offload_tags, self._state_tags = _sleep_tags(config)
        self._suspend_by = compat.support_for(compat.installed_version()).sleep_suspend
        self._extent: Extent | None = None

    @property
    def _owner(self) -> str:
        """The arena extent's owner: the pool name the worker set (:func:`set_owner`), else this process's."""
        return _owner_name or self._default_owner

    @property
    def arena(self) -> PinnedArena | None:
        """The host arena this engine sleeps into (``None``: vLLM's own host copies)."""
        return self._arena

    @property
    def extent_bytes(self) -> int:
        """Bytes of the arena this engine holds asleep (0: none)."""
        return self._extent.size if self._extent is not None else 0

    def _level_one(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether vLLM's ``suspend`` call asks for a level-1 sleep: ``suspend(level)`` with level 1, or
        (``VersionSupport.sleep_suspend == "discardable"``) ``suspend(discardable)`` with nothing to drop."""
        if self._suspend_by == "level":
            return (args[0] if args else kwargs.get("level", 1)) == 1
        return not (args[0] if args else kwargs.get("discardable", ()))

    def suspend(self, *args: Any, **kwargs: Any) -> None:
        """A level-1 sleep into an arena extent when one fits; otherwise vLLM's ``cumem`` backend with the
        same arguments (``suspend(level)``, or ``suspend(discardable)`` where vLLM passes that)."""
        level_one = self._level_one(args, kwargs)
        if not level_one or self._arena is None or self._extent is not None:
            self._suspend_in_vllm(level_one, args, kwargs)
            return
        from vllm.device_allocator.cumem import libcudart

        allocator, kept = _level_one_allocations((*self._offload_tags, *self._state_tags))
        need = sum(d.handle[1] for d in kept)
        extent = self._arena.arena.take(need, self._owner) if need else None
        if extent is None:
            logger.warning(
                "host arena %s has no room for %s: sleeping with vLLM's own host copies",
                self._arena.arena.path,
                format_bytes(need),
            )
            self._suspend_in_vllm(level_one, args, kwargs)
            return
        t0 = time.perf_counter()
        try:
            pin_s = self._arena.pin_extent(extent)
            host = self._arena.view(extent)
            base, at, copies = host.data_ptr(), 0, []
            for data in kept:
                size = data.handle[1]
                libcudart.cudaMemcpy(base + at, data.handle[2], size)
                copies.append((data, host[at : at + size]))
                at += size
        except BaseException:
            self._arena.arena.give_back(extent)
            raise
        self._state = "SUSPENDED"
        allocator.sleep(offload_tags=())  # vLLM unmaps and releases every allocation; nothing to copy
        for data, view in copies:
            data.cpu_backup_tensor = view  # what vLLM's wake_up copies back from
        self._extent = extent
        logger.info(
            "slept into host arena %s: %s at offset %s in %.3f s (pinning %.3f s)",
            self._arena.arena.path,
            format_bytes(need),
            format_bytes(extent.offset),
            time.perf_counter() - t0,
            pin_s,
        )

    def _suspend_in_vllm(self, level_one: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """vLLM's ``cumem`` sleep with vLLM's host copies; where requests are kept through it (state tags:
        ``suspend(level)`` versions only), what vLLM's backend does, with the state's tags copied too."""
        if not self._state_tags:
            super().suspend(*args, **kwargs)
            return
        from vllm.device_allocator import get_mem_allocator_instance

        self._state = "SUSPENDED"
        offload = (*self._offload_tags, *self._state_tags) if level_one else self._state_tags
        get_mem_allocator_instance().sleep(offload_tags=offload)

    def demote(self, buffers: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Turn this engine's level-1 sleep in the arena into a level-2 one (see the module docstring): the
        host copies of ``buffers`` (the model's named buffers, for the worker to restore on wake-up as after
        vLLM's own level-2 sleep), then the extent given back and every allocation left without a host copy,
        so that the wake-up maps them empty for ``reload_weights``. :class:`RuntimeError` when this engine
        is not asleep in the arena."""
        extent, arena = self._extent, self._arena
        if extent is None or arena is None:
            raise RuntimeError("not asleep in the host arena: nothing to demote")
        from vllm.device_allocator import get_mem_allocator_instance

        allocator: Any = get_mem_allocator_instance()
        asleep = [
            (address, data)
            for address, data in allocator.pointer_to_data.items()
            if data.tag in self._offload_tags and data.cpu_backup_tensor is not None
        ]
        saved = host_copies(buffers, {address: data.cpu_backup_tensor for address, data in asleep})
        for _, data in asleep:
            data.cpu_backup_tensor = None
        for data in allocator.pointer_to_data.values():  # the kept requests' state leaves the extent
            if data.tag in self._state_tags and data.cpu_backup_tensor is not None:
                data.cpu_backup_tensor = data.cpu_backup_tensor.clone()
        arena.arena.give_back(extent)
        self._extent = None
        logger.info(
            "demoted to level 2: %s of host arena %s given back (%d buffers kept)",
            format_bytes(extent.size),
            arena.arena.path,
            len(saved),
        )
        return saved

    def resume(self, tags: list[str] | None = None) -> None:
        """vLLM's wake-up; the extent goes back to the arena once nothing is read from it any more."""
        super().resume(tags)
        extent, arena = self._extent, self._arena
        if extent is None or arena is None:
            return
        from vllm.device_allocator import get_mem_allocator_instance

        allocator: Any = get_mem_allocator_instance()
        allocations = allocator.pointer_to_data.values()
        if any(d.cpu_backup_tensor is not None for d in allocations):
            return  # a partial wake-up (tags): some copies still live in the extent
        arena.arena.give_back(extent)
        self._extent = None
