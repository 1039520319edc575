"""The elastic storage behind one SGLang KV pool: spaces, geometry, data-plane group and ledger.

:class:`ElasticBacking` is built once per pool (per scheduler process: SGLang TP ranks each own their
pool, world size 1, :class:`elastic_kv.ledger.page_mapper.LocalMapper`) from the pool's buffers and block
families:

* one :class:`elastic_kv._vmm.TensorSpace` per SGLang allocation (a layer's fused K/V tensor, or its
  K and V tensors), reserved at full size so addresses never change; SGLang's tensors are views of them;
* a :class:`elastic_kv.geometry.BlockGeometry` saying which bytes each block occupies;
* a :class:`elastic_kv._vmm.SpaceGroup` over the spaces, driven through a ``LocalMapper``;
* the ledger (:class:`elastic_kv.ledger.Ledger`), which hands out block ids, maps their pages
  before returning them, keeps the null block 0 backed, and publishes the pool in the registry.

The backend follows the pool's device: ``cpu`` -> ``HostBackend`` (real host virtual memory),
``cuda[:n]`` -> ``CudaBackend(n)``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from elastic_kv.errors import ConfigError
from elastic_kv.geometry import BlockFamily, BlockGeometry

if TYPE_CHECKING:
    from elastic_kv.ledger import Ledger
    from elastic_kv.registry import PoolRecord
    from elastic_kv.snapshot import PoolSnapshot

    from sglang_elastic_kv.config import PluginConfig

__all__ = ["BufferSpec", "ElasticBacking"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferSpec:
    """One SGLang allocation to reserve: a name for logs and its size in bytes."""

    name: str
    nbytes: int


def _device_name(dev: torch.device) -> str:
    """The registry's name for ``dev`` (:func:`elastic_kv.device.device_key`: ``cpu``, or the GPU's UUID),
    the same name a vLLM engine or another SGLang rank on that device uses, so they share its budget."""
    from elastic_kv.device import device_key

    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return device_key("hip" if torch.version.hip else "cuda", index)
    return device_key("cpu")


def _backend_for(dev: torch.device) -> Any:
    from elastic_kv import _vmm

    if dev.type == "cpu":
        return _vmm.HostBackend()
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return _vmm.CudaBackend(index)
    raise ConfigError(f"--kv-cache-backend=elastic supports cpu and cuda devices, not {dev}")


class ElasticBacking:
    """Spaces, geometry, data-plane group and ledger of one pool; see the module docstring."""

    def __init__(
        self,
        *,
        spaces: list[Any],
        geometry: BlockGeometry,
        group: Any,
        ledger: Ledger,
        record: PoolRecord | None,
        buffers: Sequence[BufferSpec],
        handles: Any = None,
    ) -> None:
        self.spaces = spaces
        self.handles = handles  # the group's HandlePool: physical handles kept for reuse after unmaps
        self.geometry = geometry
        self.group = group
        self.ledger = ledger
        self.record = record
        self.buffers = tuple(buffers)
        # One flat uint8 tensor per space (keeps the space alive); SGLang's buffers are views of these.
        self._flat = [torch.from_dlpack(space) for space in spaces]

    @classmethod
    def create(
        cls,
        *,
        device: str | torch.device,
        buffers: Sequence[BufferSpec],
        families: Sequence[BlockFamily],
        num_blocks: int,
        config: PluginConfig,
        label: str,
        part: str | None = None,
        follows_limit: bool = True,
    ) -> ElasticBacking:
        """Reserve the spaces for ``buffers`` and build the ledger over ``num_blocks`` blocks.

        ``families`` say where each block lives (see :class:`BlockFamily`); block 0 is the padding
        block SGLang writes dummy tokens to and stays backed. ``part`` names one of several pools of one
        engine (SGLang's hybrid SWA pool has a ``full`` and an ``swa`` part): its registry name is
        ``<ELASTIC_KV_POOL_NAME or sglang>-<part>``. ``follows_limit=False``: a pool whose engine cannot act
        on a limit: it starts without the ``ELASTIC_KV_LIMIT`` byte limit and its record refuses one from
        ``kvctl`` (``PoolInfo.follows_limit``; the device budget still applies). Raises ConfigError
        when the layout cannot be served (e.g. a block larger than the largest logical page the config
        allows).
        """
        from elastic_kv import _vmm
        from elastic_kv.device import default_min_free_bytes
        from elastic_kv.ledger import Ledger
        from elastic_kv.ledger.page_mapper import LocalMapper
        from elastic_kv.registry import PoolRecord

        dev = torch.device(device)
        backend = _backend_for(dev)
        _, total = backend.mem_info()
        defaults: dict[str, object] = {}
        if dev.type != "cpu":
            # SGLang may still run kernels over blocks freed this step (overlap scheduling): their pages
            # wait for the allocators' epoch release. The host backend has no asynchronous work.
            if "ELASTIC_KV_DEFER_RELEASE" not in config.pool_environ:
                defaults["defer_release"] = True
            # Room for what the engines allocate outside their KV cache during a burst.
            if "ELASTIC_KV_MIN_FREE" not in config.pool_environ:
                defaults["min_free_bytes"] = default_min_free_bytes(int(total))
        if not follows_limit:
            defaults["limit_bytes"] = 0
        pool_config = config.pool_config(**defaults)
        geometry = BlockGeometry(
            [b.nbytes for b in buffers],
            families,
            num_blocks,
            pool_config.page_size,
            max_page_slots=pool_config.max_page_slots,
        )
        spaces = [_vmm.TensorSpace(backend, size, pool_config.page_size) for size in geometry.space_sizes]
        # No handle cache: an unmapped page's memory goes back to the driver at once, so the pool holds what
        # it is charged for (plus the zero page); the ledger's mapped reserve spares most map/unmap cycles.
        handles = _vmm.HandlePool(backend, 0)
        group = _vmm.SpaceGroup(spaces, geometry.extent_tuples(), geometry.num_pages, handles)
        name = pool_config.pool_name or "sglang"
        record = PoolRecord.create(
            f"{name}-{part}" if part else name,
            device=_device_name(dev),
            engine="sglang",
            model=label,
            limit_bytes=pool_config.limit_bytes,
            registry_dir=pool_config.registry_dir,
            device_total_bytes=total,
            suffix_if_taken=pool_config.pool_name is None,
            follows_limit=follows_limit,
        )
        try:
            ledger = Ledger(
                geometry,
                LocalMapper(group),
                pool_config,
                record=record,
                name=record.name,
                null_block=0,
                physical_free=lambda: int(backend.mem_info()[0]),
            )
        except BaseException:
            record.close()
            raise
        return cls(
            spaces=spaces,
            geometry=geometry,
            group=group,
            ledger=ledger,
            record=record,
            buffers=buffers,
            handles=handles,
        )

    def view(self, space: int, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` at byte ``offset`` of space ``space`` (contiguous, row-major)."""
        count = 1
        for dim in shape:
            count *= int(dim)
        nbytes = count * dtype.itemsize
        flat = self._flat[space]
        if offset < 0 or offset + nbytes > flat.numel():
            raise ValueError(f"view of {nbytes} B at {offset} exceeds space {space} ({flat.numel()} B)")
        return flat[offset : offset + nbytes].view(dtype).view(tuple(int(d) for d in shape))

    def snapshot(self) -> PoolSnapshot:
        """The ledger's statistics of this pool (physical bytes, used/free blocks, limit ...)."""
        return self.ledger.snapshot()

    def release_cached_handles(self) -> int:
        """Release every physical handle the data plane keeps for reuse after unmaps (to the driver on a
        GPU, to the OS on the host); returns the bytes released. Unmapped pages hold no memory after it."""
        return int(self.handles.trim(0)) if self.handles is not None else 0

    def publish(self) -> None:
        """Publish the ledger's statistics to the registry now (``kvctl``), outside its own schedule."""
        if self.record is not None:
            self.record.publish(self.ledger.snapshot())

    def close(self) -> None:
        """Unmap every page and leave the registry; the pool's tensors must no longer be used."""
        self.ledger.close()
        if self.record is not None:
            self.record.close()

    def describe(self) -> str:
        """One line for logs."""
        return f"{len(self.spaces)} space(s); {self.geometry.describe()}"
