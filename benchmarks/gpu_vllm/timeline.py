"""Where the engine's time goes in the GPU proof's bursts: the engine thread's phases (:class:`Timeline`),
the garbage collector's pauses (:class:`GcPauses`) and, with ``--gpu-times``, the GPU's own timeline of the
steps from CUDA events (:class:`StepSpans`). Each wraps bound methods on their instances in the engine's
child process; nothing of vLLM's classes changes."""

from __future__ import annotations

import bisect
import gc
import statistics
import time
from typing import Any


class GcPauses:
    """Counts the garbage collector's pauses (all generations) while entered."""

    def __init__(self) -> None:
        self.seconds, self.count, self._t0 = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)


class Timeline:
    """Where the engine's time goes: wall and thread-CPU seconds per phase, summed over every call made while
    ``on``.

    Wraps bound methods on their instances (nothing of vLLM's classes changes), four clock reads a call:
    the engine core's step phases (``schedule``, the model's ``execute``, ``update`` from its output), the KV
    cache manager's ``allocate_slots`` inside ``schedule`` and, with the elastic backend, the pool's own
    hooks (arrivals mapped ahead in ``add_request``), the scheduler thread's waits for the driver
    (synchronous maps, background maps it needs now), and the worker rank's request handling -- maps, the
    zeroing of new pages, releases -- off the engine thread: on the scheduler's mapper thread, or on the
    rank's socket listener with ``--socket``.
    Wall well above CPU means the thread waited: for the GPU, the driver, or the interpreter lock.
    """

    # With ``traced=True`` a key also sorts its wall time by when the call began, counted from the start
    # of the burst (``start``): these bounds, in seconds.
    PHASES = (0.1, 0.5)

    def __init__(self) -> None:
        self.on = False
        self.start = 0.0
        self.seconds: dict[str, list[float]] = {}
        self.calls: dict[str, int] = {}
        self.phased: dict[str, list[float]] = {}
        # With ``edges=True``: the wall seconds of each burst's first and last call, summed over the bursts
        # (the first schedule and the last update are the engine thread's work while the GPU idles).
        self.edges: dict[str, list[float]] = {}
        self._latest: dict[str, float] = {}  # wall of the latest call this burst (keys with edges)

    def begin(self, start: float) -> None:
        """A burst starts at ``start`` (perf_counter): time calls from now."""
        self.start, self.on = start, True
        self._latest.clear()

    def end(self) -> None:
        """The burst ended: stop timing; its last calls count as the last."""
        self.on = False
        for key, wall in self._latest.items():
            self.edges[key][1] += wall

    def wrap(self, obj: Any, name: str, key: str, traced: bool = False, edges: bool = False) -> None:
        inner = getattr(obj, name)
        spent, calls = [0.0, 0.0], self.calls
        self.seconds[key], calls[key] = spent, 0
        phased = self.phased.setdefault(key, [0.0] * (len(self.PHASES) + 1)) if traced else None
        first_last = self.edges.setdefault(key, [0.0, 0.0]) if edges else None
        latest = self._latest

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                wall = time.perf_counter() - t0
                spent[0] += wall
                spent[1] += time.thread_time() - c0
                calls[key] += 1
                if phased is not None:
                    phased[bisect.bisect(self.PHASES, t0 - self.start)] += wall
                if first_last is not None:
                    if key not in latest:
                        first_last[0] += wall
                    latest[key] = wall

        setattr(obj, name, timed)

    def report(self) -> dict[str, dict[str, Any]]:
        return {
            k: {"s": round(wall, 4), "cpu_s": round(cpu, 4), "calls": self.calls[k]}
            | ({"phased_s": [round(x, 4) for x in self.phased[k]]} if k in self.phased else {})
            | ({"first_last_s": [round(x, 4) for x in self.edges[k]]} if k in self.edges else {})
            for k, (wall, cpu) in self.seconds.items()
        }


class StepSpans:
    """The GPU's own timeline of the bursts' steps (``--gpu-times``), from CUDA events on the engine's
    stream: one recorded when ``execute_model`` is called, one after ``sample_tokens`` returns. Per step
    that gives its *span* (the GPU from the step's first kernel to its sampler's last, including any wait
    for the step's own launches) and the *gap* before it (the GPU idle between the previous step's end
    and this one's start: the engine thread was late). Decode steps (one token per request) replay one
    CUDA graph, so their span is the kernels' own time; comparing it between the engines separates a
    slower GPU (the elastic cache's memory, its maps' page-table updates) from a slower engine thread
    (gaps). With the elastic backend a step also counts as *mapping* when the worker's rank was mapping
    pages at any time between the previous step's end and this one's, on the host's clock."""

    def __init__(self) -> None:
        import torch

        self._event = lambda: torch.cuda.Event(enable_timing=True)
        self.on = False
        self.map_events = 0  # rank map calls begun or returned (counted on the rank's thread)
        self.maps_running = 0  # rank map calls begun and not yet returned
        self._seen = 0  # map_events when the previous step ended
        self._open: tuple[Any, str] | None = None  # (start event, kind) of the step being launched
        self._steps: list[tuple[Any, Any, str, bool]] = []  # recorded, not yet read
        self.spans: dict[str, list[float]] = {}  # kind -> ms
        self.gaps: dict[str, list[float]] = {}
        self._bounds: list[Any] = []  # events recorded at the burst's start and end
        self.edges: dict[str, list[float]] = {"lead": [], "first": [], "tail": []}  # ms, per burst

    def begin(self) -> None:
        """The burst starts (``generate`` is called): record on the idle stream, then time its steps."""
        self._bounds = [self._event()]
        self._bounds[0].record()
        self.on = True

    def end(self) -> None:
        """``generate`` returned: record the burst's end, stop timing steps."""
        self.on = False
        self._bounds.append(self._event())
        self._bounds[-1].record()

    def wrap_engine(self, executor: Any) -> None:
        execute, sample = executor.execute_model, executor.sample_tokens

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                start = self._event()
                start.record()
                tokens = scheduler_output.total_num_scheduled_tokens
                kind = "decode" if tokens == len(scheduler_output.num_scheduled_tokens) else "prefill"
                self._open = (start, kind)
            return execute(scheduler_output, *args, **kwargs)

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            out = sample(*args, **kwargs)
            if self._open is not None:
                end = self._event()
                end.record()
                start, kind = self._open
                events, self._open = self.map_events, None
                self._steps.append((start, end, kind, self.maps_running > 0 or events != self._seen))
                self._seen = events
            return out

        executor.execute_model, executor.sample_tokens = execute_model, sample_tokens

    def wrap_maps(self, target: Any) -> None:
        inner = target.map

        def map_pages(*args: Any, **kwargs: Any) -> Any:
            self.map_events += 1
            self.maps_running += 1
            try:
                return inner(*args, **kwargs)
            finally:
                self.maps_running -= 1
                self.map_events += 1

        target.map = map_pages

    def burst_done(self) -> None:
        """Read the burst's events (the caller synchronized the device). Besides each step's span and gap:
        the burst's *lead*, from ``generate``'s call to its first step's start (requests taken in, the
        first step scheduled), the span of its *first* step (launched from idle), and its *tail*, from its
        last sampler's end to ``generate``'s return (the last output processed and returned): the engine
        thread's time before and after the GPU works."""
        if self._steps and len(self._bounds) == 2:
            self.edges["lead"].append(self._bounds[0].elapsed_time(self._steps[0][0]))
            self.edges["first"].append(self._steps[0][0].elapsed_time(self._steps[0][1]))
            self.edges["tail"].append(self._steps[-1][1].elapsed_time(self._bounds[1]))
        previous = None
        for start, end, kind, mapping in self._steps:
            key = f"{kind}, rank mapping" if mapping else kind
            self.spans.setdefault(key, []).append(start.elapsed_time(end))
            if previous is not None:
                self.gaps.setdefault(key, []).append(max(0.0, previous.elapsed_time(start)))
            previous = end
        self._steps, self._open = [], None

    def report(self) -> dict[str, dict[str, float]]:
        return {
            key: {
                "steps": len(spans),
                "span_ms": round(statistics.fmean(spans), 4),
                "gap_ms": round(statistics.fmean(self.gaps[key]), 4) if self.gaps.get(key) else 0.0,
            }
            for key, spans in sorted(self.spans.items())
        }

    def edges_report(self) -> dict[str, float]:
        """Mean lead, first step's span and tail of the bursts, in ms (see :meth:`burst_done`)."""
        return {f"{edge}_ms": round(statistics.fmean(ms), 4) for edge, ms in self.edges.items() if ms}
