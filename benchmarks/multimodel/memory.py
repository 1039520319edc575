"""KV memory per model over time, sampled while a trace replays.

Elastic set-ups: the physical bytes each pool has backed (``charged_bytes`` of its record in the
elastic-kv registry -- what ``kvctl list --json`` prints), read in this process through
``elastic_kv.registry.Registry`` every ``period`` seconds. A model whose engine is not running (asleep
and stopped, or not started yet) has no record and counts 0. Static set-up: each engine's KV cache is
allocated once at start-up, so its size is constant and is recorded once. The sleep set-up also records
each model's state (awake, asleep, waking, ...) and the host memory asleep models' weights take
(``host_used_bytes``) from ``elastic-kv serve``'s ``/status`` with every sample.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["RegistrySampler"]

logger = logging.getLogger(__name__)


class RegistrySampler:
    """Samples ``{model: backed bytes}`` from a registry directory on a thread, between start() and stop().

    ``pools`` maps each pool name to the model it serves. Samples are ``(t, {model: bytes})`` with ``t`` in
    seconds since ``t0`` (``time.perf_counter`` based, the replay's clock).
    """

    def __init__(
        self,
        registry_dir: Path,
        pools: Mapping[str, str],
        period_s: float,
        states: Callable[[], tuple[dict[str, str], int]] | None = None,
    ) -> None:
        from elastic_kv.registry import Registry

        self._registry = Registry(registry_dir)
        self._pools = dict(pools)
        self._period = period_s
        self._states = states
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, dict[str, int], tuple[dict[str, str], int] | None]] = []
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

    def _sample(self) -> None:
        states = None
        if self._states is not None:
            try:
                states = self._states()
            except Exception as exc:  # a sample without states; the replay goes on
                logger.debug("no model states: %s", exc)
        self.samples.append((time.perf_counter() - self.t0, self.read(), states))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._halt.wait(self._period):
                return

    def stop(self) -> list[dict[str, Any]]:
        """Stop sampling; the samples as JSON-ready rows ``{"t": s, "kv": {model: bytes}}`` (plus
        ``"state": {model: state}`` and ``"host": bytes`` where a state reader was given)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        rows: list[dict[str, Any]] = []
        for t, kv, extra in self.samples:
            row: dict[str, Any] = {"t": round(t, 3), "kv": kv}
            if extra is not None:
                row["state"], row["host"] = extra
            rows.append(row)
        return rows
