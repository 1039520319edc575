"""Memory readings of the GPU proof's engines: the driver's free memory (host memory under
``--cpu-smoke``), this engine's use derived from it (:class:`Memory`), and a sampler that reads it, with the
scheduler's and the elastic pool's counters, through a burst (:class:`Sampler`)."""

from __future__ import annotations

import threading
import time
from typing import Any


def memory_probe(cpu_smoke: bool) -> tuple[Any, Any, str]:
    """(free-memory reading, synchronize, device name): the driver's on a GPU; host memory in CPU smoke
    mode, which only checks this script itself on a machine without a GPU."""
    if cpu_smoke:
        import psutil

        return (
            (lambda: (psutil.virtual_memory().available, psutil.virtual_memory().total)),
            (lambda: None),
            "cpu",
        )
    import torch

    return torch.cuda.mem_get_info, torch.cuda.synchronize, torch.cuda.get_device_name(0)


class Sampler:
    """Reads the driver's free memory (and the elastic pool's counters) every ``period`` seconds while
    ``active`` (this engine's bursts: meanwhile the other engine idles, so the readings are this one's)."""

    def __init__(self, probe: Any, period: float = 0.02) -> None:
        self.active = False
        self.samples: list[dict[str, Any]] = []
        self._probe = probe
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.active:
                self.samples.append(self._probe())
            self._stop.wait(self._period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class Memory:
    """One engine's memory use and its scheduler's and pool's counters (:meth:`probe`), read in its own
    child process.

    This engine's use = ``base`` + the drop of free memory since ``free`` was read. The other engine changes
    its use only in its own bursts, and returns to its idle use after them; this one reads memory only
    while the other idles: while it starts (base: its idle use), then in and after its own bursts, from
    a reading just before each (:meth:`rebase`, :meth:`reread`)."""

    def __init__(self, cpu_smoke: bool) -> None:
        self.mem_get_info, self.synchronize, self.device = memory_probe(cpu_smoke)
        self.base, self.free = 0, 0
        self._cpu_smoke = cpu_smoke
        self._core: Any = None
        self._scheduler: Any = None
        self._pool: Any = None

    def rebase(self, base: int) -> None:
        """The engine uses ``base`` bytes now: count its use from here."""
        self.base, self.free = base, self.mem_get_info()[0]

    def reread(self) -> None:
        """Read free memory anew, keeping the base (just before a burst, from idle)."""
        self.free = self.mem_get_info()[0]

    def attach(self, core: Any, pool: Any) -> None:
        """Read the counters of this engine core's scheduler and of its elastic pool (None: native)."""
        self._core, self._scheduler, self._pool = core, core.scheduler, pool

    def probe(self) -> dict[str, Any]:
        """One reading: the time, this engine's use, its scheduler's queues and the pool's counters."""
        free, _ = self.mem_get_info()
        scheduler = self._scheduler
        sample = {
            "t": time.perf_counter(),
            "used": self.base + self.free - free,
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
        }
        pool = self._pool
        if pool is not None:
            sample.update(charged=pool.ledger.charged_bytes, steps=pool.steps, driver_steps=pool.driver_steps)
        return sample

    def drain(self) -> None:
        """Process the step still in flight, as vLLM's engine-core process does by itself: its busy loop
        runs while ``batch_queue`` is not empty (``EngineCore.has_work``). In-process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) ``LLM.generate`` returns once every request finished, and
        with async scheduling the step scheduled after the last output stays queued until the next
        request -- with it the pages it may still read, which the pool releases only after it."""
        core = self._core
        while getattr(core, "batch_queue", None):
            core.step_fn()

    def idle(self, timeout: float = 20.0) -> dict[str, Any]:
        """Wait for the pool to settle (its releases run behind), then read memory."""
        self.drain()
        deadline = time.monotonic() + timeout
        last = self.probe()
        while self._pool is not None and time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.probe()
            # the host's memory (--cpu-smoke) moves with every other process: the pool's charge only
            if now["charged"] == last["charged"] and (self._cpu_smoke or now["used"] == last["used"]):
                break
            last = now
        self.synchronize()
        return self.probe()
