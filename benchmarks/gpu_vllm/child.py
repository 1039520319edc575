"""One engine of the GPU proof, in a child process of its own (``ci/gpu_vllm.py --child SLOT``): starts vLLM
with its slot's backend, instruments it, runs the greedy comparison, then bursts on the parent's commands,
and reports what it measured (:mod:`benchmarks.gpu_vllm.protocol`).

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uni executor), so the scheduler's
pool and the worker's data plane are read directly here.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_vllm.memory import Memory, Sampler
from benchmarks.gpu_vllm.models import GREEDY_TOKENS, SPECULATIVE, burst_prompts, greedy_prompts
from benchmarks.gpu_vllm.protocol import backend, say
from benchmarks.gpu_vllm.timeline import GcPauses, StepSpans, Timeline


def run_child(args: argparse.Namespace) -> None:
    """One engine: set up, check, then run bursts on the parent's command (see
    :func:`benchmarks.gpu_vllm.cli.main`)."""
    child = _Child(args)
    before = child.memory.idle()
    tokens = child.greedy_tokens()
    settled = child.warm_up()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()  # what a long-running server does after start-up: older objects leave the collector
    say({"event": "ready", "startup_s": round(child.startup, 2), "tokens": tokens})

    profiler = cProfile.Profile() if args.profile else None
    pauses = GcPauses()
    sampler = Sampler(child.memory.probe)
    with sampler, pauses:
        bursts = child.run_bursts(sampler, profiler)
    after = child.memory.idle()  # (the other engine is still up and idle: the parent lets both exit together)
    if profiler is not None:
        _write_profile(profiler, Path(args.out) / f"profile_{args.child}_{child.backend}.txt")
    say(child.report(before, settled, after, bursts, sampler, pauses))
    sys.stdin.read()  # until the parent closes it: both engines exit only once both reported


@dataclass
class _Bursts:
    """What the bursts measured: ``generate``'s wall and engine-thread CPU seconds, summed, each burst's
    tokens per second, and the sampler's readings up to the end of the first burst."""

    seconds: float = 0.0
    cpu: float = 0.0
    tokens_per_s: list[float] = field(default_factory=list)
    first: list[dict[str, Any]] = field(default_factory=list)


class _Child:
    """The slot's engine, started and instrumented; its methods are the steps of :func:`run_child`."""

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        self.args = args
        self.memory = Memory(args.cpu_smoke)
        self.backend = backend(args.child, args)
        if self.backend == "elastic":
            _register_plugin(args.socket)
        options = _engine_options(args, self.backend)
        self.memory.rebase(0)  # the engine's start counts from here
        t0 = time.perf_counter()
        self.llm = LLM(
            model=args.model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            max_model_len=2048,
            seed=0,
            **options,
        )
        self.startup = time.perf_counter() - t0
        core = self.llm.llm_engine.engine_core.engine_core
        self.pool: Any = getattr(core.scheduler, "elastic_pool", None)  # None: native
        self.worker_pool: Any = getattr(core.model_executor.driver_worker.worker, "_elastic_pool", None)
        self.memory.attach(core, self.pool)
        self.timeline, self.spans = _instrument(core, self.pool, self.worker_pool, args.gpu_times)
        self.greedy = SamplingParams(
            max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False
        )
        self.burst_params = SamplingParams(
            max_tokens=args.output, temperature=0.0, ignore_eos=True, detokenize=False
        )

    def greedy_tokens(self) -> list[list[int]]:
        """The greedy comparison: this engine's tokens for each of :func:`greedy_prompts`."""
        outputs = self.llm.generate(greedy_prompts(self.args.cpu_smoke), self.greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def warm_up(self) -> dict[str, Any]:
        """A small burst, then the idle reading that this engine's use counts from (its base)."""
        self.llm.generate(burst_prompts(8, self.args.prompt, 1), self.burst_params, use_tqdm=False)
        settled = self.memory.idle()
        self.memory.rebase(settled["used"])
        return settled

    def run_bursts(self, sampler: Sampler, profiler: cProfile.Profile | None) -> _Bursts:
        """Bursts on the parent's commands, each from idle, until a command other than ``burst``."""
        bursts = _Bursts()
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] != "burst":
                break
            self._burst(command["seed"], bursts, sampler, profiler)
            if not bursts.first:
                bursts.first = list(sampler.samples)
            say({"event": "burst", "tokens_per_s": bursts.tokens_per_s[-1]})
        return bursts

    def _burst(self, seed: int, bursts: _Bursts, sampler: Sampler, profiler: cProfile.Profile | None) -> None:
        """One burst from idle (the elastic pool grows from its reserve every time), added to ``bursts``."""
        timeline, spans = self.timeline, self.spans
        self.memory.idle()
        self.memory.reread()
        prompts = burst_prompts(self.args.requests, self.args.prompt, seed)
        cpu0, t1 = time.thread_time(), time.perf_counter()
        timeline.begin(t1)
        sampler.active = True
        if spans is not None:
            spans.begin()
        with profiler or contextlib.nullcontext():
            outs = self.llm.generate(prompts, self.burst_params, use_tqdm=False)
        timeline.end()
        sampler.active = False
        if spans is not None:
            spans.end()
        took, bursts.cpu = time.perf_counter() - t1, bursts.cpu + time.thread_time() - cpu0
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        bursts.seconds += took
        bursts.tokens_per_s.append(round(made / took, 1))
        if spans is not None:
            self.memory.synchronize()
            spans.burst_done()

    def report(
        self,
        before: dict[str, Any],
        settled: dict[str, Any],
        after: dict[str, Any],
        bursts: _Bursts,
        sampler: Sampler,
        pauses: GcPauses,
    ) -> dict[str, Any]:
        """The ``done`` message: the engine's throughput, time and memory (``before`` the greedy comparison,
        ``settled`` after the warm-up, ``after`` the bursts), and the elastic pool's counters."""
        spans = self.spans
        result: dict[str, Any] = {
            "event": "done",
            "backend": self.backend,
            "device": self.memory.device,
            "vllm": __import__("vllm").__version__,
            "burst_seconds": round(bursts.seconds, 3),
            "burst_tokens_per_s_each": bursts.tokens_per_s,
            # Where the bursts' time went on the engine's thread: its own CPU time, and garbage collection.
            "burst_thread_cpu_s": round(bursts.cpu, 3),
            "burst_gc_s": round(pauses.seconds, 3),
            "burst_gc_collections": pauses.count,
            "gc_tracked_objects": len(gc.get_objects()),
            "timeline": self.timeline.report(),
            "gpu_step_times": spans.report() if spans is not None else None,
            "gpu_burst_edges": spans.edges_report() if spans is not None else None,
            "used_before": before["used"],
            "used_idle_before_burst": settled["used"],
            "used_max_during": max(s["used"] for s in sampler.samples),
            "used_after": after["used"],
        }
        if self.pool is not None:
            result.update(self._pool_report(before, after, bursts, sampler))
        return result

    def _pool_report(
        self, before: dict[str, Any], after: dict[str, Any], bursts: _Bursts, sampler: Sampler
    ) -> dict[str, Any]:
        """The elastic pool's part of the report: its pages, charges, steps and driver calls."""
        pool, worker_pool = self.pool, self.worker_pool
        snap = pool.ledger.snapshot()
        backend_calls = worker_pool.backend if worker_pool is not None else None
        return {
            "page_bytes": snap.page_bytes,
            "blocks_per_page": snap.blocks_per_page,
            "total_blocks": snap.total_blocks,
            "reserve_min_bytes": pool.reserve_min_pages * snap.page_bytes,
            "reserve_max_bytes": pool.plugin.elastic.reserve_max_pages * snap.page_bytes,
            "charged_before": before["charged"],
            "charged_peak": max(s["charged"] for s in sampler.samples),
            "charged_after": after["charged"],
            "reserve_pages_after": snap.reserve_pages,
            "steps_total": pool.steps,
            "driver_steps_total": pool.driver_steps,
            "steady_decode": _steady_decode(bursts.first, self.args.requests),
            "background_maps": pool.mapper.async_jobs,
            "releases": pool.mapper.releases,
            "reserve_hit_rate": round(snap.reserve_hit_rate, 3),
            "driver_calls": {op: backend_calls.calls(op) for op in ("create", "map", "unmap", "set_access")}
            if backend_calls is not None
            else {},
        }


def _steady_decode(first_burst: list[dict[str, Any]], requests: int) -> dict[str, int]:
    """Steps and steps that waited for the driver while the first burst decoded with every request running
    (none waiting), from the sampler's readings."""
    full = [s for s in first_burst if s["waiting"] == 0 and s["running"] == requests]
    if len(full) < 2:
        return {"steps": 0, "driver_steps": 0}
    return {
        "steps": full[-1]["steps"] - full[0]["steps"],
        "driver_steps": full[-1]["driver_steps"] - full[0]["driver_steps"],
    }


def _register_plugin(socket: bool) -> None:
    """Register the elastic backend, as the plugin's entry point does; explicit, so that the plugin's source
    folder on PYTHONPATH suffices on a machine where it was not pip-installed (idempotent when the entry
    point ran too). With ``socket`` the scheduler reaches the worker's rank through its socket."""
    import vllm_elastic_kv

    vllm_elastic_kv.register()
    if socket:
        from vllm_elastic_kv.scheduler import scheduler_pool

        scheduler_pool.local_rank = lambda instance, rank: None  # type: ignore[assignment]


def _engine_options(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """The engine's options beyond the model: the backend, speculative decoding, dtype and memory."""
    additional: dict[str, Any] = {"kv_cache_backend": "elastic"} if backend == "elastic" else {}
    if args.model == "gdn":
        # vLLM picks FlashInfer's GDN prefill on Hopper, which the GPU machine's bundle lacks: both engines
        # run Triton's (FLA), which is also what vLLM runs on every other platform.
        additional["gdn_prefill_backend"] = "triton"
    extra: dict[str, Any] = {"additional_config": additional} if additional else {}
    if args.speculative:
        extra["speculative_config"] = SPECULATIVE[args.speculative]
    if args.cpu_smoke:
        extra.update(enforce_eager=True, dtype="float32", kv_cache_memory_bytes=256 << 20)
    else:
        extra.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization)
    return extra


def _instrument(core: Any, pool: Any, worker_pool: Any, gpu_times: bool) -> tuple[Timeline, StepSpans | None]:
    """The engine's timeline (the engine core's phases, the elastic pool's hooks and the worker rank's work)
    and, with ``--gpu-times``, its steps' spans on the GPU."""
    timeline = Timeline()
    scheduler = core.scheduler
    timeline.wrap(scheduler, "schedule", "schedule", edges=True)
    timeline.wrap(core.model_executor, "execute_model", "execute")
    timeline.wrap(core.model_executor, "sample_tokens", "execute: sample")
    timeline.wrap(scheduler, "update_from_output", "update", edges=True)
    timeline.wrap(scheduler.kv_cache_manager, "allocate_slots", "schedule: allocate_slots")
    if pool is not None:
        timeline.wrap(pool, "step_dispatched", "elastic: step_dispatched (in schedule)")
        timeline.wrap(pool, "step_completed", "elastic: step_completed (in update)")
        timeline.wrap(pool.mapper, "map", "elastic: scheduler thread waits for map")
        timeline.wrap(pool.mapper, "unmap", "elastic: scheduler thread waits for unmap")
        timeline.wrap(
            pool.mapper, "collect", "elastic: scheduler thread collects background maps", traced=True
        )
        timeline.wrap(pool.ledger, "expect", "elastic: arrivals mapped ahead (in add_request)")
    target = _time_rank(timeline, worker_pool)
    spans = StepSpans() if gpu_times else None
    if spans is not None:
        spans.wrap_engine(core.model_executor)
        if target is not None:
            spans.wrap_maps(target)
    return timeline, spans


def _time_rank(timeline: Timeline, worker_pool: Any) -> Any:
    """Time the worker rank's request handling; returns what the rank maps pages through (None: native)."""
    if worker_pool is None or worker_pool.rank is None:
        return None
    # Whoever carries the requests (the mapper's thread directly, or a socket listener) calls this.
    timeline.wrap(worker_pool.rank, "dispatch", "elastic: rank applies requests (off the engine thread)")
    target = worker_pool.rank._pools[0].target
    if hasattr(target, "_zero"):  # the worker's _ZeroingTarget: where a map's time goes
        timeline.wrap(target, "map", "elastic: rank maps pages (driver and zeroing)", traced=True)
        timeline.wrap(target, "_zero", "elastic: rank zeroes new pages")
        timeline.wrap(target, "commit", "elastic: rank releases pages")
    return target


def _write_profile(profiler: cProfile.Profile, path: Path) -> None:
    """The bursts' profile (``--profile``): the top 60 functions by own time, then by cumulative time."""
    with open(path, "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(60)
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
