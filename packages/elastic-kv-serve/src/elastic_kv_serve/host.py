"""Host memory: the budget for asleep models' weights, the arena that holds it, and each sleep's level.

An engine asleep at level 1 keeps its weights in host memory (a fast wake: one copy back); at level 2 it
drops them (a wake reloads them from the checkpoint); in ``stop`` mode its process is gone. Without a bound,
level-1 sleeps of many models exhaust the host: seven asleep 8B models hold about 95 GiB, and the kernel
then kills one. So the server owns one :class:`elastic_kv.host.HostArena` of ``[server] host_budget`` bytes
(of ``host_memory``, default the host's memory), created and filled when it starts, in
``host_arena_dir`` (default the registry directory: ``/dev/shm``). The engines that keep their level-1
copies there (vLLM through the plugin's sleep-mode backend, ``command`` engines) find it through
``ELASTIC_KV_HOST_ARENA``. A sleep is level 1 when the arena has an extent free for the model's weights,
else level 2 where the engine can reload them, else a stop: asleep weights never outgrow the budget.

SGLang keeps its level-1 copies in memory of its own; such a sleep is level 1 only while the host's
available memory stays above :data:`HOST_RESERVE_FRACTION` of its total after it.

The arena exists only where some model sleeps through an engine that uses it; elsewhere (the CPU, where
engines stop to sleep) nothing is allocated.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psutil
from elastic_kv.errors import ConfigError
from elastic_kv.host import HostArena
from elastic_kv.sizes import Percent, format_bytes

from elastic_kv_serve.config import ModelConfig
from elastic_kv_serve.kinds import EngineKind

__all__ = ["ARENA_NAME", "HOST_RESERVE_FRACTION", "HostMemory", "host_total_bytes", "resolve_host_budget"]

logger = logging.getLogger(__name__)

ARENA_NAME = "serve-host.arena"
HOST_RESERVE_FRACTION = 0.1  # of the host's memory, kept available beside asleep copies outside the arena


def host_total_bytes() -> int:
    """The host's physical memory."""
    return int(psutil.virtual_memory().total)


def resolve_host_budget(budget: int | Percent | None, host_memory: int | None) -> int:
    """The host budget in bytes (0: none)."""
    if budget is None:
        return 0
    if isinstance(budget, int):
        return budget
    return budget.of(host_memory if host_memory is not None else host_total_bytes())


class HostMemory:
    """The server's host budget and, where needed, its arena (see the module docstring)."""

    def __init__(self, budget_bytes: int, directory: Path) -> None:
        self.budget_bytes = budget_bytes
        self.path = directory / ARENA_NAME
        self.arena: HostArena | None = None

    def create_arena(self) -> None:
        """Create and fill the arena (about 10 GiB/s); :class:`ConfigError` (one line) when the budget is 0,
        more than the host has available, or more than the file system holds."""
        if self.budget_bytes <= 0:
            raise ConfigError(
                "server.host_budget: models sleep through their engines; a host budget is needed"
            )
        available = int(psutil.virtual_memory().available)
        if self.budget_bytes > available:
            raise ConfigError(
                f"server.host_budget: {format_bytes(self.budget_bytes)} is more than the host has available "
                f"({format_bytes(available)})"
            )
        self.arena = HostArena.create(self.path, self.budget_bytes)
        logger.info("host arena %s: %s for asleep weights", self.path, format_bytes(self.arena.size))

    def close(self) -> None:
        """Remove the arena (engines are stopped by then)."""
        if self.arena is not None:
            self.arena.close()
            self.arena.remove()
            self.arena = None

    def used_bytes(self) -> int:
        """Bytes of asleep weights in the arena."""
        return self.arena.used_bytes() if self.arena is not None else 0

    def by_owner(self) -> dict[str, int]:
        """Arena bytes per owner (the engines name their extents after their pools)."""
        out: dict[str, int] = {}
        for extent in self.arena.extents() if self.arena is not None else ():
            out[extent.owner] = out.get(extent.owner, 0) + extent.size
        return out

    def reclaim_dead(self) -> int:
        """Give back the extents of engines that died; the bytes reclaimed."""
        return sum(e.size for e in self.arena.reclaim_dead()) if self.arena is not None else 0

    def fits(self, *sizes: int) -> bool:
        """Whether extents of ``sizes``, taken one after another, all fit in the arena now."""
        return self.arena is not None and all(self.arena.would_take(sizes))

    def level_for(self, kind: EngineKind, model: ModelConfig, need_bytes: int, parked_bytes: int = 0) -> int:
        """The sleep level for ``model`` (of ``kind``) whose level-1 copy takes ``need_bytes``: 1 when its
        copy fits (in the arena, after the ``parked_bytes`` of KV a suspension parks there first where they
        fit; or in the host's available memory for engines that keep it themselves), else 2 where the
        model's weights can be reloaded, else 0 (stop the engine)."""
        levels = kind.levels_for(model)
        if 1 in levels:
            if kind.uses_arena:
                fits = self.arena is not None and self.arena.would_take([parked_bytes, need_bytes])[-1]
            else:
                memory = psutil.virtual_memory()
                fits = memory.available - need_bytes >= HOST_RESERVE_FRACTION * memory.total
            if fits:
                return 1
        return 2 if 2 in levels else 0
