"""Memory facts the sleep manager works from: weights, the device's size, KV from the pool records, and the
device budget that ``kvctl budget`` shows.

* Weights: the model's ``weights_bytes`` when the config gives it, else the size of the checkpoint's weight
  files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``) in a local model directory -- what the
  engine loads when it keeps the checkpoint's dtype. A hub id without a local directory counts 0 (logged).
* Device size (for ``budget = "80%"``): ``device_memory`` from the config, else GPU 0's memory through NVML
  where there is a GPU, else the host's physical memory.
* KV: the ``charged_bytes`` of each model's pool records in the registry (physical bytes backed now).
* Budget: one device budget (``elastic_kv.registry.budget``) covers every pool's KV on a device. The
  server keeps it at *budget - weights of the awake models*, so weights and KV together stay within
  ``[server] budget``, and restores the device's previous budget when it stops.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from elastic_kv.registry import UNLIMITED, PoolInfo, Registry
from elastic_kv.sizes import Percent

__all__ = ["BudgetKeeper", "checkpoint_bytes", "device_total_bytes", "pool_names", "resolve_budget"]

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def checkpoint_bytes(model: str) -> int:
    """Bytes of the weight files of a local checkpoint directory ``model``; 0 if it is not one."""
    path = Path(model).expanduser()
    if not path.is_dir():
        logger.warning(
            "weights of %s unknown (not a local directory): set weights_bytes in its config", model
        )
        return 0
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))


def device_total_bytes() -> int:
    """GPU 0's memory through NVML when a GPU is there, else the host's physical memory."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_budget(budget: int | Percent | None, device_memory: int | None) -> int | None:
    """The budget in bytes (``None`` = no budget)."""
    if budget is None or isinstance(budget, int):
        return budget
    return budget.of(device_memory if device_memory is not None else device_total_bytes())


def pool_names(pool: str) -> frozenset[str]:
    """The record names one engine's pool may have: its own, or its parts (SGLang's hybrid SWA pools)."""
    return frozenset({pool, f"{pool}-full", f"{pool}-swa"})


class BudgetKeeper:
    """Keeps the device budget of every device the server's pools live on at a target, and restores it."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._previous: dict[str, int] = {}  # device -> budget before the server set it
        self._set: dict[str, int] = {}

    def apply(self, devices: Iterable[str], kv_budget: int | None) -> None:
        """Set each device's budget to ``kv_budget`` bytes (``None``: leave it alone)."""
        if kv_budget is None:
            return
        value = max(1, kv_budget)  # 0 would mean unlimited in the registry
        for device in devices:
            if self._set.get(device) == value:
                continue
            if device not in self._previous:
                known = {d.device: d.budget_bytes for d in self._registry.devices(reclaim=False)}
                self._previous[device] = known.get(device, UNLIMITED)
            self._registry.set_budget(device, value)
            self._set[device] = value
            logger.info("device %s: KV budget %d bytes", device, value)

    def restore(self) -> None:
        """Put back every budget this keeper changed."""
        for device, previous in self._previous.items():
            try:
                self._registry.set_budget(device, previous)
            except Exception as exc:  # a broken registry must not stop the shutdown
                logger.warning("could not restore the budget of %s: %s", device, exc)
        self._previous.clear()
        self._set.clear()


def kv_by_pool(pools: Iterable[PoolInfo]) -> dict[str, tuple[int, str]]:
    """``record name -> (charged bytes, device)`` for every live record."""
    return {p.name: (p.charged_bytes, p.device) for p in pools}
