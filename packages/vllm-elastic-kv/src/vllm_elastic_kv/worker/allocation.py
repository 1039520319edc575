"""The KV cache allocation context: vLLM's own allocation lands in elastic spaces, unchanged otherwise.

Every supported vLLM allocates the KV cache with ``torch.zeros(nbytes, dtype=torch.int8, device=...)``
inside ``Worker._maybe_get_memory_pool_context("kv_cache")`` (0.29+: one call for the backing buffer,
``vllm.v1.worker.utils.allocate_kv_cache``; 0.26-0.28: one per ``KVCacheTensor``), and then builds every
per-layer view with its own layout code. The worker returns :class:`KVAllocation` as that context: a
``TorchFunctionMode`` (PyTorch's public interposition API) that answers exactly those calls with a tensor
over a fresh :class:`elastic_kv._vmm.TensorSpace` and lets every other call through. vLLM's views, strides
and attention backends then see the same tensor shapes they see natively.

Why not a ``torch.cuda.MemPool`` with a pluggable allocator (what vLLM's sleep mode uses there): it needs a
C allocator with ``malloc``/``free`` symbols, is CUDA-only, and would back the whole range at once.

Unbacked parts of a space alias the data plane's zero page, so the new tensor reads as zeros, as
``torch.zeros`` promises. The context checks on exit that it served exactly the allocations the
``KVCacheConfig`` describes: if vLLM changed how it allocates, start-up fails with a ConfigError instead of
silently running on native memory.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from elastic_kv.errors import ConfigError
from torch.overrides import TorchFunctionMode

__all__ = ["KVAllocation", "planned_allocations"]

logger = logging.getLogger(__name__)


def planned_allocations(kv_cache_config: Any, kv_allocation: str) -> list[int]:
    """Byte sizes of the ``torch.zeros`` calls vLLM makes for ``kv_cache_config`` (compat's ``kv_allocation``:
    ``"one_buffer"`` -- one backing buffer; ``"per_tensor"`` -- one per unpacked ``KVCacheTensor``)."""
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        return []
    if kv_allocation == "one_buffer":
        return [tensors[0].size]
    return [t.size for t in tensors if not getattr(t, "block_stride", 0)]


class KVAllocation(TorchFunctionMode):
    """Serves the planned KV cache ``torch.zeros`` calls from ``make_space(nbytes)`` (see module docstring).

    ``planned``: the byte sizes vLLM will ask for, in any order. ``device``: the worker's device; a call for
    another device type, dtype or size passes through. ``make_space(nbytes)`` returns an object that
    ``torch.from_dlpack`` accepts (a ``TensorSpace``) covering at least ``nbytes``. After the block,
    :attr:`spaces` and :attr:`tensors` hold what was served, in call order.
    """

    def __init__(
        self, planned: Sequence[int], device: torch.device, make_space: Callable[[int], Any]
    ) -> None:
        super().__init__()
        self._left = collections.Counter(planned)
        self._planned = list(planned)
        self._device = torch.device(device)
        self._make_space = make_space
        self.spaces: list[Any] = []
        self.tensors: list[torch.Tensor] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros:
            nbytes = self._planned_size(args, kwargs)
            if nbytes is not None:
                return self._serve(nbytes)
        return func(*args, **kwargs)

    def _planned_size(self, args: Sequence[Any], kwargs: dict[str, Any]) -> int | None:
        if kwargs.get("dtype") is not torch.int8 or kwargs.get("out") is not None:
            return None
        device = kwargs.get("device")
        if device is None or torch.device(device).type != self._device.type:
            return None
        size: Any = kwargs.get("size", args[0] if len(args) == 1 else args)
        if isinstance(size, (tuple, list, torch.Size)):
            if len(size) != 1:
                return None
            size = size[0]
        if not isinstance(size, int) or self._left[size] <= 0:
            return None
        return size

    def _serve(self, nbytes: int) -> torch.Tensor:
        self._left[nbytes] -= 1
        space = self._make_space(nbytes)
        flat = torch.from_dlpack(space)
        tensor = flat[:nbytes].view(torch.int8)
        if tensor.device.type != self._device.type or (
            self._device.index is not None and tensor.device.index != self._device.index
        ):
            raise ConfigError(
                f"vllm-elastic-kv: the elastic space is on {tensor.device}, the worker on {self._device}"
            )
        self.spaces.append(space)
        self.tensors.append(tensor)
        logger.debug("KV allocation of %d bytes served from an elastic space at %#x", nbytes, space.base)
        return tensor

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        result = super().__exit__(exc_type, exc, tb)
        if exc_type is None and any(n > 0 for n in self._left.values()):
            missing = sorted(self._left.elements())
            raise ConfigError(
                f"vllm-elastic-kv: vLLM did not allocate the KV cache as planned (allocations of {missing} "
                "bytes never came): this vLLM allocates it some other way, which the plugin does not support"
            )
        return result
