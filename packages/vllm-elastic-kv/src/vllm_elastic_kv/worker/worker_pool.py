"""One worker process's share of the elastic KV pool: its spaces, its ``SpaceGroup`` and its rank.

Life cycle (driven by :class:`vllm_elastic_kv.worker.worker.ElasticWorkerMixin`):

1. :meth:`WorkerPool.allocation` -- the context vLLM allocates the KV cache in; its ``torch.zeros`` calls
   are served from fresh ``TensorSpace``\\ s (:mod:`vllm_elastic_kv.worker.allocation`);
2. :meth:`WorkerPool.finish` -- once vLLM bound the per-layer views to its attention layers: the geometry
   of those real views (pages as the scheduler planned them), a ``SpaceGroup`` over the spaces, a
   :class:`~elastic_kv.ranks.Rank` serving it, and a :class:`~elastic_kv.ranks.SocketListener` on
   ``socket_path(instance, rank)``, where the scheduler's coordinator finds it. The rank is also listed
   in this process (:func:`local_rank`): when the scheduler runs in the worker's process (one rank,
   vLLM's ``UniProcExecutor``) its coordinator calls the rank directly, with no socket, no encoding and
   no listener thread between them;
3. :meth:`WorkerPool.close` -- stop listening, release every page and the spaces.

The scheduler decides every map and unmap; this side only executes them. Newly mapped pages are zeroed
on GPUs (a fresh driver allocation holds arbitrary bytes, and vLLM's own cache starts as zeros); the
memsets are queued before the map is acknowledged, and the worker orders each step after them
(:meth:`WorkerPool.order_step`), so the step that first uses a page never sees garbage.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from elastic_kv import _vmm
from elastic_kv.errors import ConfigError
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ranks import Rank, SocketListener, socket_path

from vllm_elastic_kv.compat import VersionSupport
from vllm_elastic_kv.config import PluginConfig
from vllm_elastic_kv.layout import check_plan, check_spaces, observed_geometry, planned_spaces, pool_geometry
from vllm_elastic_kv.worker.allocation import KVAllocation
from vllm_elastic_kv.worker.parking import ParkingTarget, block_ranges

__all__ = ["WorkerPool", "local_rank", "make_backend", "serve_locally"]

logger = logging.getLogger(__name__)

# The ranks this process serves, by (engine instance, rank index): see local_rank.
_LOCAL_RANKS: dict[tuple[str, int], Rank] = {}


def local_rank(instance: str, rank: int) -> Rank | None:
    """The rank ``rank`` of engine ``instance`` if this process serves it (its worker runs here), else
    None."""
    return _LOCAL_RANKS.get((instance, rank))


def serve_locally(instance: str, rank: Rank | None) -> None:
    """List ``rank`` (its index is ``rank.rank``) as served by this process for engine ``instance``, so that
    a scheduler in this process calls it directly; ``serve_locally(instance, None)`` withdraws every rank
    of ``instance`` listed here."""
    if rank is None:
        for key in [k for k in _LOCAL_RANKS if k[0] == instance]:
            del _LOCAL_RANKS[key]
    else:
        _LOCAL_RANKS[(instance, rank.rank)] = rank


def make_backend(device: torch.device) -> Any:
    """The data-plane backend for a torch device: host memory for ``cpu``, the CUDA (or ROCm) driver for
    ``cuda:N``. ConfigError for anything else."""
    if device.type == "cpu":
        return _vmm.HostBackend()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if getattr(torch.version, "hip", None):
            return _vmm.HipBackend(index)
        return _vmm.CudaBackend(index)
    raise ConfigError(f"vllm-elastic-kv has no data-plane backend for device {device}")


class _ZeroingTarget:
    """The rank's view of the ``SpaceGroup``: every call is the group's, and ``map`` also zeroes the new
    pages' blocks (exact block byte ranges, so no neighbour's bytes are touched).

    On a GPU the memsets run on a stream of their own and ``map`` returns once they are queued: it waits
    neither for a forward pass in flight nor for the memsets. Two waits keep that safe:

    * the engine's next step: :meth:`order_step` (the worker calls it before each ``execute_model``) makes
      the engine's stream wait, on the GPU, for every memset queued so far. A page is mapped, and its
      memsets queued, before the scheduler hears of it, so the first step that may use it is ordered
      after them;
    * unmapping: :meth:`prepare`, :meth:`unmap` and :meth:`close` wait on the host for the memsets first,
      so none writes to an address after its page is gone.

    ``map`` does not wait for the memsets on the host because under a prefill they queue behind the
    forward's kernels: waiting would hold the rank, and a scheduler waiting for its maps, for the forward.
    """

    def __init__(self, group: Any, geometry: BlockGeometry, flats: Sequence[torch.Tensor]) -> None:
        self._group = group
        self._geo = geometry
        self._flats = flats
        cuda = bool(flats) and flats[0].is_cuda
        self._stream = torch.cuda.Stream(flats[0].device) if cuda else None
        self._zeroed = torch.cuda.Event() if cuda else None  # recorded after the latest memsets
        self._queued = 0  # memset batches queued (rank thread, under the rank's lock)
        self._ordered = 0  # batches the engine's stream was made to wait for (engine thread)
        self._synced = 0  # batches the host waited for (rank thread)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def map(self, pages: Sequence[int]) -> None:
        self._group.map(pages)
        if self._stream is None:
            self._zero(pages)
            return
        assert self._zeroed is not None
        try:
            with torch.cuda.stream(self._stream):
                self._zero(pages)
        finally:  # memsets queued before a failure are waited for like the others
            self._zeroed.record(self._stream)
            self._queued += 1

    def order_step(self) -> None:
        """Make the current stream (the engine's, before a step) wait for every memset queued so far."""
        queued = self._queued
        if queued != self._ordered and self._stream is not None and self._zeroed is not None:
            # The latest record covers every earlier batch (one stream, in order). A record that races
            # with this call is a later one: waiting for it too is only conservative.
            torch.cuda.current_stream(self._stream.device).wait_event(self._zeroed)
            self._ordered = queued

    def _settle(self) -> None:
        """Wait on the host for every memset queued so far (before anything is unmapped)."""
        queued = self._queued
        if queued != self._synced and self._zeroed is not None:
            self._zeroed.synchronize()
            self._synced = queued

    def prepare(self, tx: int, pages: Sequence[int]) -> None:
        self._settle()
        self._group.prepare(tx, pages)

    def unmap(self, pages: Sequence[int]) -> None:
        self._settle()
        self._group.unmap(pages)

    def close(self) -> None:
        self._settle()
        self._group.close()

    def _zero(self, pages: Sequence[int]) -> None:
        """Zero the blocks of ``pages`` with one ``_foreach_zero_`` (torch's multi-tensor kernels, as its
        optimizers use): a few kernel launches instead of one ``zero_`` per byte range, and about half the
        GPU time (``benchmarks/map_under_load.py``)."""
        geo = self._geo
        ranges = [
            self._flats[space][lo:hi]
            for run in _block_runs(geo, pages)
            for space, lo, hi in block_ranges(geo, run)
        ]
        if ranges:
            torch._foreach_zero_(ranges)


def _block_runs(geometry: BlockGeometry, pages: Sequence[int]) -> list[range]:
    """The blocks of ``pages`` as maximal runs of consecutive block ids: pages the ledger maps together
    are mostly neighbours, and one memset per run and family costs what one per page did."""
    runs: list[range] = []
    for page in sorted(pages):
        blocks = geometry.blocks_of(page)
        if runs and runs[-1].stop == blocks.start:
            runs[-1] = range(runs[-1].start, blocks.stop)
        elif len(blocks):
            runs.append(blocks)
    return runs


class WorkerPool:
    """See the module docstring. ``rank`` is the worker's global rank (TP rank; PP is refused)."""

    def __init__(
        self,
        plugin: PluginConfig,
        support: VersionSupport,
        kv_cache_config: Any,
        vllm_config: Any,
        device: torch.device,
        rank: int,
        *,
        zero_on_map: bool | None = None,
    ) -> None:
        if plugin.instance is None:
            raise ConfigError("vllm-elastic-kv: the engine was not activated by the front end (no instance)")
        self.plugin = plugin
        self.support = support
        self.kv_cache_config = kv_cache_config
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.rank_index = rank
        self.backend = make_backend(self.device)
        self._zero_on_map = self.backend.name != "host" if zero_on_map is None else zero_on_map
        self.planned = pool_geometry(
            kv_cache_config,
            vllm_config,
            support.kv_allocation,
            plugin.elastic,
            auto_page_size="page_size" not in plugin.chosen and self.device.type == "cuda",
            split_kv=self.device.type == "cuda" and torch.version.hip is not None,
        )
        self._allocation: KVAllocation | None = None
        self.geometry: BlockGeometry | None = None
        self.handle_pool: Any = None
        self.group: Any = None
        self._zeroing: _ZeroingTarget | None = None
        self.parking: ParkingTarget | None = None
        self.rank: Rank | None = None
        self.listener: SocketListener | None = None

    # -- 1. allocation ------------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        """True once the allocation context was handed out (vLLM allocates the KV cache once)."""
        return self._allocation is not None

    @property
    def spaces(self) -> list[Any]:
        """The ``TensorSpace``\\ s the KV cache was allocated in, in allocation order (empty before)."""
        return list(self._allocation.spaces) if self._allocation is not None else []

    def allocation(self) -> KVAllocation:
        """The context for vLLM's KV cache allocation (usable once). Each allocation is served from a space of
        the size the plan gives it (:func:`~vllm_elastic_kv.layout.planned_spaces`), which may exceed the
        allocation: every byte a page's extents touch must lie inside the space."""
        if self._allocation is not None:
            raise RuntimeError("the KV cache allocation context was already used")
        page = self.planned.page_size
        spaces = planned_spaces(self.planned, self.kv_cache_config, self.support.kv_allocation)
        reserve: dict[int, int] = {}
        for nbytes, size in spaces:  # allocations of one size have one layout: the same space size
            reserve[nbytes] = max(size, reserve.get(nbytes, 0))
        self._allocation = KVAllocation(
            [nbytes for nbytes, _ in spaces],
            self.device,
            lambda nbytes: _vmm.TensorSpace(self.backend, reserve[nbytes], page),
        )
        return self._allocation

    # -- 2. serving -----------------------------------------------------------------------------------
    def finish(self, views: Sequence[torch.Tensor]) -> None:
        """Build the group and start serving the scheduler, from the per-layer ``views`` vLLM bound."""
        alloc = self._allocation
        if alloc is None or not alloc.spaces:
            raise ConfigError("vllm-elastic-kv: vLLM bound its KV cache without allocating it in our context")
        spaces = alloc.spaces
        observed = observed_geometry(
            [v for v in views if v.numel()],
            [s.base for s in spaces],
            [s.size for s in spaces],
            self.kv_cache_config.num_blocks,
            self.planned.page_size,
            self.planned.blocks_per_page,
            self.support.kv_allocation,
        )
        check_plan(self.planned, observed)
        check_spaces(observed, [s.size for s in spaces])
        self.geometry = observed
        # No handle cache: an unmapped page's memory goes back to the driver at once, so what the rank holds
        # is what the pool is charged for (plus the zero page the spaces show where nothing is mapped). The
        # ledger's mapped reserve already spares most map/unmap cycles.
        self.handle_pool = _vmm.HandlePool(self.backend, 0)
        self.group = _vmm.SpaceGroup(spaces, observed.extent_tuples(), observed.num_pages, self.handle_pool)
        flats = [torch.from_dlpack(s) for s in spaces]
        target: Any = self.group
        if self._zero_on_map:
            target = self._zeroing = _ZeroingTarget(self.group, observed, flats)
        self.rank = rank = Rank(self.rank_index)
        arena = None
        if self.plugin.elastic.host_arena is not None:
            from vllm_elastic_kv.worker.sleep import process_arena

            arena = process_arena(self.plugin.elastic.host_arena)
        owner = self.plugin.elastic.pool_name or f"vllm-{os.getpid()}"
        # vLLM's null block (block 0) stays mapped through every sleep, as the scheduler keeps it.
        self.parking = ParkingTarget(
            target, self.group, observed, flats, rank.exclusive, arena=arena, owner=owner,
            resident=frozenset({0}),
        )  # fmt: skip
        rank.add_pool(self.parking, backend=self.backend, handle_pool=self.handle_pool)
        assert self.plugin.instance is not None
        self.listener = SocketListener(self.rank, socket_path(self.plugin.instance, self.rank_index))
        serve_locally(self.plugin.instance, self.rank)
        logger.info(
            "elastic KV rank %d serving %s on %s", self.rank_index, observed.describe(), self.backend.name
        )

    def order_step(self) -> None:
        """Before a step's kernels are queued on the current stream: order them after the zeroing of every
        page mapped so far (a no-op when nothing was mapped since the last step, and off GPUs)."""
        target = self._zeroing
        if target is not None:
            target.order_step()

    def info(self) -> dict[str, Any]:
        """This rank's physical state, for diagnostics (``collective_rpc("elastic_kv_info")``)."""
        group = self.group
        return {
            "pid": os.getpid(),
            "rank": self.rank_index,
            "backend": self.backend.name,
            "mapped_pages": group.num_mapped if group is not None else 0,
            "mapped_bytes": group.mapped_bytes if group is not None else 0,
            "live_handles": self.backend.live_handles,
            "live_bytes": self.backend.live_bytes,
            "parked_bytes": self.parking.parked_bytes if self.parking is not None else 0,
            "geometry": self.geometry.describe() if self.geometry is not None else None,
        }

    # -- 3. teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving and release the group (idempotent). vLLM still holds tensors over the spaces;
        they keep the reservations alive, now aliasing the zero page."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.rank is not None and self.group is not None:
            assert self.plugin.instance is not None
            serve_locally(self.plugin.instance, None)
            # A coordinator that still calls this rank directly gets UNKNOWN_POOL (it stops the pool, as a
            # closed socket stops it) instead of reaching a closed group.
            self.rank.remove_pool(0)
        if self.group is not None:
            # The parking target gives its host copy back; the zeroing target waits for its memsets first.
            (self.parking or self._zeroing or self.group).close()
            self.group = self._zeroing = self.parking = None
