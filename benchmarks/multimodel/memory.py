"""KV memory per model over time, sampled while a trace replays.

Elastic set-ups: the physical bytes each pool has backed (``charged_bytes`` of its record in the
elastic-kv registry -- what ``kvctl list --json`` prints), read in this process through
``elastic_kv.registry_view.Registry`` every ``period`` seconds. A model whose engine is not running (asleep
and stopped, or not started yet) has no record and counts 0. Static set-up: each engine's KV cache is
allocated once at start-up, so its size is constant and is recorded once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["RegistrySampler"]


class RegistrySampler:
    """Samples ``{model: backed bytes}`` from a registry directory on a thread, between start() and stop().

    ``pools`` maps each pool name to the model it serves. Samples are ``(t, {model: bytes})`` with ``t`` in
    seconds since ``t0`` (``time.perf_counter`` based, the replay's clock).
    """

    def __init__(self, registry_dir: Path, pools: Mapping[str, str], period_s: float) -> None:
        from elastic_kv.registry_view import Registry

        self._registry = Registry(registry_dir)
        self._pools = dict(pools)
        self._period = period_s
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.budget_bytes = 0

    def read(self) -> dict[str, int]:
        """One reading now: backed bytes per model (0 for a model without a live pool)."""
        out = dict.fromkeys(self._pools.values(), 0)
        for pool in self._registry.pools(reclaim=False):
            model = self._pools.get(pool.name)
            if model is not None:
                out[model] += int(pool.charged_bytes)
        return out

    def device_budget(self) -> int:
        """The largest device budget in the registry (0 = none set)."""
        return max((d.budget_bytes for d in self._registry.devices(reclaim=False)), default=0)

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.samples = []
        self.budget_bytes = self.device_budget()
        self._halt.clear()
        self._thread = threading.Thread(target=self._run, name="kv-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.samples.append((time.perf_counter() - self.t0, self.read()))
            if self._halt.wait(self._period):
                return

    def stop(self) -> list[dict[str, Any]]:
        """Stop sampling; the samples as JSON-ready rows ``{"t": s, "kv": {model: bytes}}``."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append((time.perf_counter() - self.t0, self.read()))
        return [{"t": round(t, 3), "kv": kv} for t, kv in self.samples]
