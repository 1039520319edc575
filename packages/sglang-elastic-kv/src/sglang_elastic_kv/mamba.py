"""The per-request state of Mamba / linear-attention hybrids on elastic memory: the state super-cell.

SGLang keeps a hybrid model's recurrent state in its request pool (``HybridReqToTokenPool``): a
``MambaPool`` holds, for every state slot, each linear layer's conv state(s) and its temporal (SSM) state,
as tensors ``(layers, slots + 1, *state_shape)``; a ``MambaSlotAllocator`` hands slot ids out (one per
running request, more for prefix-cache checkpoints and ping-pong tracking buffers) and slot 0 is the dummy
slot padded rows write to. Here:

* :class:`ElasticMambaPool` keeps that layout (same shapes, same strides, same kernels) but reserves each
  state tensor as an elastic space. A ledger *block* is one slot: the **super-cell** of that slot's bytes in
  every layer of every state tensor (one block family per layer and tensor), mapped together when the
  slot is taken and unmapped together when its page empties. Block 0, the dummy slot, stays backed.
* :class:`ElasticMambaSlotAllocator` is SGLang's slot allocator whose free list holds only backed slots:
  a slot is taken from the ledger (which maps its page first) when an allocation needs it and goes back
  to the ledger when SGLang frees it: a request finishing, a retraction, or the Mamba radix cache
  evicting a cached state. ``available_size()`` stays logical (SGLang's idle leak check counts on it);
  :meth:`ElasticMambaSlotAllocator.schedulable_available_size` is what can be backed now.
* The state pool is bounded by SGLang's own slot count (``--max-mamba-cache-size``), which its admission
  respects (it caps running requests by it); ``ELASTIC_KV_LIMIT`` is not applied to it, because SGLang
  0.5.23 treats a state slot it cannot get as fatal (an assertion in ``HybridReqToTokenPool.alloc``), so
  a byte limit below the live states' need could only crash the engine. For the same reason its registry
  record follows no limit: ``kvctl limit`` on ``<name>-mamba`` is refused in one line. The device budget
  still counts the pool, and admission counts the state slots it lets be backed
  (:meth:`ElasticMambaSlotAllocator.elastic_admission_room`, read by the KV allocator's prefill budget):
  under a tight budget new requests wait for slots instead of reaching SGLang's fatal assertion.
* :class:`ElasticHybridReqToTokenPool` is SGLang's ``HybridReqToTokenPool`` with both of them. The
  hook on ``KVCacheConfigurator._build_hybrid_req_pool`` makes SGLang build it with its own arguments.

The attention layers of such a model live in ``HybridLinearKVPool``, whose full-attention pool is the
elastic MHA pool (platform seam); its token allocator drives this allocator's release epochs
(:meth:`ElasticMambaSlotAllocator.elastic_step_begin` / ``_end``), so that on a GPU a slot freed while
a batch may still read it is unmapped only after that batch. Configurations whose state SGLang lays out
differently or keeps elsewhere (speculative decoding, ReplaySSM rings, the page-major envelope layout,
AMX/NPU conv layouts, int8 checkpoints, PLE side states, the memory saver) are refused with ConfigError.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from elastic_kv.errors import ConfigError
from elastic_kv.geometry import BlockFamily
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool

from sglang_elastic_kv import compat
from sglang_elastic_kv.backing import BufferSpec, ElasticBacking
from sglang_elastic_kv.config import PluginConfig

__all__ = ["ElasticHybridReqToTokenPool", "ElasticMambaPool", "ElasticMambaSlotAllocator"]

logger = logging.getLogger(__name__)

_MAMBA_POOL = "sglang.srt.mem_cache.memory_pool.MambaPool"


def _refuse(what: str, checks: dict[str, bool]) -> None:
    bad = [name for name, present in checks.items() if present]
    if bad:
        raise ConfigError(
            f"--kv-cache-backend=elastic cannot serve this {what}: {', '.join(bad)}. "
            "Use --kv-cache-backend=native for this configuration."
        )


class ElasticMambaPool(MambaPool):
    """``MambaPool`` whose conv and temporal state tensors live in elastic spaces (see the module doc).

    SGLang's constructor allocates the state tensors itself; it runs here at one slot (its bookkeeping,
    a few hundred bytes per layer), then the tensors are replaced by views of ``size + 1`` slots of the
    elastic spaces, so the pool never holds its full size in ordinary memory.
    """

    elastic: ElasticBacking
    mamba_cache: Any  # SGLang's State (set by its constructor, replaced by :meth:`_back`)

    def __init__(self, *, size: int, **kwargs: Any) -> None:
        from sglang.srt.utils import cpu_has_amx_support, is_cpu, is_npu

        _refuse(
            "Mamba state pool",
            {
                "speculative decoding (per-draft state buffers)": kwargs.get("speculative_num_draft_tokens")
                is not None,
                "--enable-linear-replayssm": bool(kwargs.get("enable_linear_replayssm")),
                "--enable-linear-replayssm-spec": bool(kwargs.get("enable_linear_replayssm_spec")),
                "the page-major envelope layout (--enable-page-major-kv-layout)": bool(
                    kwargs.get("envelope_layout")
                ),
                "--enable-memory-saver": bool(kwargs.get("enable_memory_saver")),
                "the AMX conv-state layout of a CPU with AMX": is_cpu() and cpu_has_amx_support(),
                "the NPU conv-state layout": is_npu(),
            },
        )
        super().__init__(size=1, **kwargs)
        compat.check_instance(self, _MAMBA_POOL)
        _refuse("Mamba state pool", {"a custom NVLink memory pool": bool(self.enable_custom_mem_pool)})
        self._back(size)

    def _back(self, size: int) -> None:
        """Reserve the state tensors at ``size + 1`` slots in elastic spaces and use views of them."""
        config = PluginConfig.from_env(os.environ)
        self.plugin_config = config
        state = self.mamba_cache
        tensors: list[torch.Tensor] = [*state.conv, state.temporal]
        slots = size + 1
        buffers: list[BufferSpec] = []
        families: list[BlockFamily] = []
        for index, tensor in enumerate(tensors):
            layers, _, *shape = tensor.shape
            slot_bytes = tensor.dtype.itemsize * int(torch.Size(shape).numel())
            name = f"conv{index}" if index < len(state.conv) else "temporal"
            buffers.append(BufferSpec(name, layers * slots * slot_bytes))
            # One family per layer: slot s of layer l is bytes [(l*slots + s)*slot_bytes, +slot_bytes).
            families += [
                BlockFamily(index, layer * slots * slot_bytes, slot_bytes, slot_bytes)
                for layer in range(layers)
            ]
        self.elastic = ElasticBacking.create(
            device=self.device,
            buffers=buffers,
            families=families,
            num_blocks=slots,
            config=config,
            label=f"mamba-{self.num_mamba_layers}l",
            part="mamba",
            # SGLang sizes running requests by the pool's slot count and treats a slot it cannot get as
            # fatal; it cannot defer or retract for a byte limit here, so ELASTIC_KV_LIMIT does not apply.
            follows_limit=False,
        )
        views = [
            self.elastic.view(index, 0, (t.shape[0], slots, *t.shape[2:]), t.dtype)
            for index, t in enumerate(tensors)
        ]
        self.mamba_cache = self.State(conv=views[:-1], temporal=views[-1])
        self.size = size
        self.mem_usage = sum(b.nbytes for b in buffers) / (1 << 30)
        # SGLang caches facts about the conv tensors on first use (fused slot-op eligibility, descriptors);
        # they described the one-slot tensors.
        for cached in ("_conv_fuse_ok", "_conv_slot_desc"):
            self.__dict__.pop(cached, None)
        self._warmup_fused_copy_slot_kernel()
        logger.info("elastic Mamba state pool: %d slots; %s", size, self.elastic.describe())


class ElasticMambaSlotAllocator(MambaSlotAllocator):
    """``MambaSlotAllocator`` whose free list holds only backed slots (ledger block id = slot id)."""

    # Slots a new request takes: its state, and the tracking buffers SGLang gives it up front
    # (``HybridReqToTokenPool.mamba_initial_tracking_slots``; set when the pool is attached).
    elastic_slots_per_request: int = 1

    def __init__(self, pool: ElasticMambaPool) -> None:
        self._pool = pool
        self._ledger = pool.elastic.ledger
        self._held = 0  # slots taken from the ledger: handed out to SGLang or waiting in free_slots
        self._prev_epoch = 0
        self._asleep = False
        super().__init__(size=pool.size, device=pool.device)
        compat.check_instance(self, "sglang.srt.mem_cache.allocator.mamba.MambaSlotAllocator")

    # -- SGLang's interface ------------------------------------------------------------------------

    def clear(self) -> None:
        """Free every slot: all go back to the ledger, which unmaps every page but the dummy slot's."""
        self._alloc_iter = None
        self._ledger.clear()
        self._ledger.release_through(self._ledger.epoch)  # clear() runs with the engine idle
        self._held = 0
        self.free_slots = torch.empty((0,), dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        """Logical free slots (backed or not): ``size`` minus the slots SGLang holds."""
        return self.size - (self._held - len(self.free_slots))

    def schedulable_available_size(self) -> int:
        """Free slots that can be backed now: backed free slots plus what the ledger can still map."""
        return min(self.available_size(), len(self.free_slots) + self._ledger.available_size())

    def elastic_admission_room(self, tree_cache: Any) -> int:
        """New requests whose state slots can be had now (read afresh, like the KV pools' headroom at
        each admission pass): slots backable now and cached states the Mamba radix cache can evict
        (SGLang evicts those before it allocates), over the slots one request takes. With a Mamba radix
        cache that is one more: once its prefill ends, SGLang checkpoints the request's state into the
        tree in a slot of its own (``prepare_for_caching_req``), and fails if it cannot get one."""
        self._ledger.refresh_room()
        per_request = self.elastic_slots_per_request
        evictable = 0
        if tree_cache is not None and tree_cache.supports_mamba():
            evictable = int(tree_cache.mamba_evictable_size())
            per_request += 1
        return (self.schedulable_available_size() + evictable) // per_request

    def _do_alloc(self, need_size: int) -> torch.Tensor | None:
        """SGLang's allocation after taking the missing slots from the ledger; None (nothing taken) when
        the ledger cannot back them now."""
        short = need_size - len(self.free_slots)
        if short > 0:
            new = self._ledger.alloc(short)
            if new is None:
                return None
            self._held += len(new)
            ids = torch.tensor(new, dtype=torch.int64, device=self.device)
            self.free_slots = torch.cat((self.free_slots, ids))
        result: torch.Tensor | None = super()._do_alloc(need_size)
        return result

    def free(self, free_index: torch.Tensor) -> None:
        """Slots SGLang frees go straight back to the ledger (which keeps a mapped reserve of its own)."""
        if free_index.numel() == 0:
            return
        ids = free_index.flatten().tolist()
        self._ledger.free(ids)
        self._held -= len(ids)

    # -- driven by the elastic token allocator of the same scheduler ---------------------------------

    def elastic_step_begin(self) -> None:
        """A new release epoch (see :meth:`ElasticAllocatorMixin.elastic_step_begin`)."""
        self._ledger.advance_epoch()

    def elastic_step_end(self) -> None:
        """Unmap what emptied before the batch that has now finished; ledger housekeeping."""
        self._ledger.release_through(self._prev_epoch)
        self._prev_epoch = self._ledger.epoch
        self._ledger.maintain()

    def elastic_idle_check(self) -> list[str]:
        """Idle: release every pending page, run housekeeping, and compare the ledger with this allocator."""
        self._ledger.release_through(self._ledger.epoch)
        if not self._asleep:
            self._ledger.maintain()
        used = self._ledger.used_blocks
        if used != self._held:
            return [f"elastic Mamba ledger has {used} live slots, the slot allocator holds {self._held}"]
        return []

    def elastic_sleep(self) -> None:
        """The engine released its memory: return the backed free slots, unmap the ledger's reserve."""
        self._asleep = True
        if len(self.free_slots):
            ids = self.free_slots.tolist()
            self.free_slots = self.free_slots[:0]
            self._ledger.free(ids)
            self._held -= len(ids)
        self._ledger.release_through(self._ledger.epoch)
        self._ledger.settle()
        self._ledger.trim()
        self._pool.elastic.release_cached_handles()
        self._pool.elastic.publish()

    def elastic_wake(self) -> None:
        """Slots are backed on demand again."""
        self._asleep = False


class ElasticHybridReqToTokenPool(HybridReqToTokenPool):
    """``HybridReqToTokenPool`` over :class:`ElasticMambaPool` and :class:`ElasticMambaSlotAllocator`."""

    mamba_pool_cls = ElasticMambaPool
    mamba_pool: ElasticMambaPool
    mamba_allocator: ElasticMambaSlotAllocator

    def _init_mamba_pool(self, *args: Any, **kwargs: Any) -> None:
        super()._init_mamba_pool(*args, **kwargs)
        compat.check_instance(self, "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool")
        _refuse(
            "hybrid request pool",
            {
                "int8 Mamba checkpoints (--enable-int8-mamba-checkpoint)": self.mamba_ckpt_pool is not None,
                "short-conv side states (Qwen4-Exp PLE)": bool(self.short_conv_pool.enabled),
                "n-gram side states (Qwen4-Exp PLE)": bool(self.ngram_pool.enabled),
            },
        )
        self.mamba_allocator = ElasticMambaSlotAllocator(self.mamba_pool)

    def clone_with_new_mamba(self, **kwargs: Any) -> HybridReqToTokenPool:
        """Multi-layer EAGLE drafts (speculative decoding) are refused."""
        raise ConfigError(
            "--kv-cache-backend=elastic does not serve speculative decoding with Mamba / linear hybrids "
            "(draft state pools); use --kv-cache-backend=native"
        )
