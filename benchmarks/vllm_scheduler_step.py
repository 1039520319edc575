"""Whole scheduler steps, vLLM's native scheduler against the elastic one, in one process (not a test).

The GPU runs of ``ci/gpu_vllm.py`` are CPU-bound on a tiny model: the engine-core thread's work per
step -- ``Scheduler.schedule()`` plus ``update_from_output()`` -- sets the throughput, so whatever the plugin
adds there shows up one for one in tokens per second. This script times exactly that work without an
engine: two schedulers built from one ``VllmConfig`` and one ``KVCacheConfig`` (vLLM's own sizing), the native
``Scheduler`` and the plugin's ``ElasticScheduler`` with everything the engine core holds -- the real ledger,
the shared registry record, the coordinator, the background pre-map thread -- and the worker's side in the
same process, as with TP=1 on a GPU: a real ``Rank`` serving a real ``SpaceGroup`` on host memory, which the
coordinator calls directly (``--socket``: through its ``SocketListener`` thread, as with several ranks).
The model runner is replaced by one sampled token per scheduled request.

Workload (the GPU run's): ``--requests`` concurrent requests of ``--prompt`` tokens generating ``--output``
tokens each, 16-token blocks; with ``--churn`` a finished request is replaced at once, so the batch stays
full and prefills, block frees and prefix-cache evictions happen every step. Steps run in alternating slices
of ``--slice`` steps (native, elastic, native, ...), so the machine's noise hits both alike; the ratio is
the median over slice pairs of elastic time / native time.

    python benchmarks/vllm_scheduler_step.py [--requests 256] [--steps 400] [--churn] [--async]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.workload import workload_parser  # noqa: E402

BLOCK = 16  # tokens per block, as on GPUs


class Driver:
    """One scheduler with its requests and a fake model runner (one token per scheduled request)."""

    def __init__(self, scheduler: Any, args: argparse.Namespace, hasher: Any) -> None:
        self.scheduler = scheduler
        self.hasher = hasher
        self.args = args
        self._ids = itertools.count()
        self._queue: deque[Any] = deque()  # scheduled steps whose output is not processed yet
        self._depth = 2 if args.async_scheduling else 1
        self.tokens = 0
        if not args.bursts:
            for _ in range(args.requests):
                self.add()

    def add(self) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        i = next(self._ids)
        # Prompt lengths spread over a block, so that every step some requests cross a block boundary.
        n = self.args.prompt + (i * 7) % BLOCK
        prompt = [(31 * i + 7 * j) % 997 + 3 for j in range(n)]
        params = SamplingParams(max_tokens=self.args.output, ignore_eos=True, temperature=0.0)
        self.scheduler.add_request(Request(f"r{i}", prompt, params, None, block_hasher=self.hasher))

    def step(self) -> None:
        """Schedule one step; process the oldest step's output once ``depth`` steps are in flight."""
        self._queue.append(self.scheduler.schedule())
        if len(self._queue) >= self._depth:
            self._process(self._queue.popleft())

    def burst(self) -> float:
        """Seconds to run ``--requests`` new requests to completion from idle, the last output included."""
        for _ in range(self.args.requests):
            self.add()
        t0 = time.perf_counter()
        while self.scheduler.has_unfinished_requests():
            self.step()
        while self._queue:  # the steps still in flight (async scheduling), as the engine core drains them
            self._process(self._queue.popleft())
        return time.perf_counter() - t0

    def _process(self, out: Any) -> None:
        """The fake model runner's output for the step ``out``, through ``update_from_output``."""
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.scheduler
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = sched.requests.get(req_id)
            done_prefill = req is not None and req.num_computed_tokens >= req.num_prompt_tokens
            sampled.append([5] if done_prefill else [])
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        before = len(sched.requests)
        sched.update_from_output(out, runner)
        self.tokens += sum(map(len, sampled))
        if self.args.churn:
            for _ in range(before - len(sched.requests)):
                self.add()


def _configs(args: argparse.Namespace, elastic: bool) -> tuple[Any, Any]:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tests.support.models import TinyModelSpec, tiny_model

    model = tiny_model(TinyModelSpec(name="tiny-llama-8l", num_hidden_layers=8))
    extra: dict[str, Any] = {}
    if elastic:
        pages = {"page_size": args.page_size}
        extra = {"additional_config": {"kv_cache_backend": "elastic", "elastic_kv": pages}}
    engine_args = EngineArgs(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=args.prompt + BLOCK + args.output + 64,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.batched_tokens,
        enforce_eager=True,
        seed=0,
        **extra,
    )
    vllm_config = engine_args.create_engine_config()
    vllm_config.cache_config.block_size = BLOCK
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(8)}
    resolve_kv_cache_layout(vllm_config, [["LBHNC"]], specs.values())  # what the engine core does first
    per_request = -(-(args.prompt + BLOCK + args.output) // BLOCK) + 2
    blocks = 2 * args.requests * per_request  # headroom for the prefix cache, as on a GPU
    [kv_cache_config] = get_kv_cache_configs(vllm_config, [specs], [blocks * spec.page_size_bytes * 8])
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return vllm_config, kv_cache_config


class WorkerSide:
    """The worker's share of the pool in this process (TP=1): spaces, group, rank, socket listener; the rank
    is listed as served here unless ``socket``, as the worker lists it in an engine."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, socket: bool) -> None:
        from elastic_kv import _vmm
        from elastic_kv.ranks import Rank, SocketListener, socket_path
        from vllm_elastic_kv import compat
        from vllm_elastic_kv.config import PluginConfig
        from vllm_elastic_kv.layout import planned_geometry
        from vllm_elastic_kv.worker.worker_pool import serve_locally

        plugin = PluginConfig.from_vllm_config(vllm_config, os.environ)
        support = compat.support_for(compat.installed_version())
        cfg = plugin.elastic
        geo = planned_geometry(kv_cache_config, vllm_config, support.kv_allocation, cfg.page_size, 8)
        self.backend = _vmm.HostBackend()
        self.spaces = [_vmm.TensorSpace(self.backend, size, cfg.page_size) for size in geo.space_sizes]
        handles = _vmm.HandlePool(self.backend, geo.page_bytes)
        self.group = _vmm.SpaceGroup(self.spaces, geo.extent_tuples(), geo.num_pages, handles)
        self.rank = Rank(0)
        self.rank.add_pool(self.group, backend=self.backend, handle_pool=handles)
        assert plugin.instance is not None
        self.listener = SocketListener(self.rank, socket_path(plugin.instance, 0))
        self.instance = plugin.instance
        if not socket:
            serve_locally(plugin.instance, self.rank)
        self.geometry = geo

    def close(self) -> None:
        from vllm_elastic_kv.worker.worker_pool import serve_locally

        serve_locally(self.instance, None)
        self.listener.close()
        self.group.close()


def _scheduler(args: argparse.Namespace, elastic: bool) -> tuple[Any, WorkerSide | None]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    if elastic:
        import vllm_elastic_kv

        vllm_elastic_kv.register()
    vllm_config, kv_cache_config = _configs(args, elastic)
    worker = WorkerSide(vllm_config, kv_cache_config, args.socket) if elastic else None
    if elastic:
        from vllm_elastic_kv.scheduler.scheduler import ElasticAsyncScheduler, ElasticScheduler

        cls: Any = ElasticAsyncScheduler if args.async_scheduling else ElasticScheduler
    else:
        cls = AsyncScheduler if args.async_scheduling else Scheduler
    sched = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        log_stats=True,  # as the engine core does when stats are logged (vLLM's default)
    )
    return sched, worker


def _mean_ci(values: list[float]) -> list[float]:
    """Mean and half-width of a 95% confidence interval (normal approximation over the slices)."""
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return [round(mean, 4), round(half, 4)]


def _print_profile_difference(profilers: dict[str, Any], steps: int, unit: str = "step") -> None:
    """Per function: calls and own time per ``unit`` on each side, the largest differences first."""
    import pstats

    own: dict[str, dict[Any, tuple[int, float]]] = {}
    for name, prof in profilers.items():
        raw = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        own[name] = {func: (entry[1], entry[2]) for func, entry in raw.items()}
    funcs = set(own["native"]) | set(own["elastic"])
    rows = []
    for func in funcs:
        n_calls, n_time = own["native"].get(func, (0, 0.0))
        e_calls, e_time = own["elastic"].get(func, (0, 0.0))
        rows.append((e_time - n_time, func, n_calls, n_time, e_calls, e_time))
    rows.sort(key=lambda r: -abs(r[0]))
    own_col, calls_col = f"own us/{unit}: native", f"calls/{unit}: native"
    print(f"{own_col:>22} {'elastic':>9} {calls_col:>20} {'elastic':>9}  function")
    for _diff, func, n_calls, n_time, e_calls, e_time in rows[:30]:
        where = f"{Path(func[0]).name}:{func[1]}({func[2]})"
        print(
            f"{n_time / steps * 1e6:22.1f} {e_time / steps * 1e6:9.1f} {n_calls / steps:20.1f} "
            f"{e_calls / steps:9.1f}  {where}"
        )


def _bursts(drivers: dict[str, Driver], args: argparse.Namespace) -> None:
    """The GPU script's pattern: bursts from idle, native and elastic alternating; prints per-burst times."""
    import cProfile

    times: dict[str, list[float]] = {name: [] for name in drivers}
    profilers = {name: cProfile.Profile() for name in drivers} if args.profile else {}
    for i in range(args.bursts + 1):  # the first pair warms up
        order = list(drivers.items())
        for name, d in order if i % 2 else reversed(order):
            gc.collect()
            prof = profilers.get(name) if i else None
            if prof is not None:
                prof.enable()
            took = d.burst()
            if prof is not None:
                prof.disable()
            if i:
                times[name].append(took)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "bursts": args.bursts,
                "requests": args.requests,
                "page_size": args.page_size,
                "burst_ms": {k: [round(t * 1e3, 1) for t in v] for k, v in times.items()},
                "ratio_of_medians": round(med["elastic"] / med["native"], 4),
            }
        )
    )
    if profilers:
        _print_profile_difference(profilers, args.bursts, unit="burst")


def _steps(drivers: dict[str, Driver], args: argparse.Namespace) -> None:
    """Steps of running requests, native and elastic in alternating slices; prints the ratios as JSON."""
    for _ in range(args.warmup):
        for d in drivers.values():
            d.step()
    profilers: dict[str, Any] = {}
    if args.profile:
        import cProfile

        profilers = {name: cProfile.Profile() for name in drivers}
    times: dict[str, list[float]] = {"native": [], "elastic": []}
    cpu: dict[str, list[float]] = {"native": [], "elastic": []}
    done = 0
    gc.collect()
    while done < args.steps:
        n = min(args.slice, args.steps - done)
        order = list(drivers.items())
        if (done // args.slice) % 2:
            order.reverse()  # alternate who goes first, so that neither side inherits the other's caches
        for name, d in order:
            prof = profilers.get(name)
            if prof is not None:
                prof.enable()
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(n):
                d.step()
            times[name].append((time.perf_counter() - t0) / n)
            cpu[name].append((time.thread_time() - c0) / n)
            if prof is not None:
                prof.disable()
        done += n
    ratios = [e / n for e, n in zip(times["elastic"], times["native"], strict=True)]
    cpu_ratios = [e / n for e, n in zip(cpu["elastic"], cpu["native"], strict=True)]
    pool = getattr(drivers["elastic"].scheduler, "elastic_pool", None)
    result = {
        "requests": args.requests,
        "running": {k: len(d.scheduler.running) for k, d in drivers.items()},
        "churn": args.churn,
        "async": args.async_scheduling,
        "steps": args.steps,
        "us_per_step": {
            k: {"median": round(statistics.median(v) * 1e6, 1), "min": round(min(v) * 1e6, 1)}
            for k, v in times.items()
        },
        "ratio_median": round(statistics.median(ratios), 4),
        "cpu_us_per_step": {k: round(statistics.median(v) * 1e6, 1) for k, v in cpu.items()},
        "cpu_ratio_median": round(statistics.median(cpu_ratios), 4),
        "cpu_ratio_mean_ci95": _mean_ci(cpu_ratios),
        "ratio_of_mins": round(min(times["elastic"]) / min(times["native"]), 4),
        "added_us_per_step_median": round(
            (statistics.median(times["elastic"]) - statistics.median(times["native"])) * 1e6, 1
        ),
        "elastic_pool": pool
        and {
            "blocks_per_page": pool.geometry.blocks_per_page,
            "steps": pool.steps,
            "driver_steps": pool.driver_steps,
            "background_maps": pool.mapper.async_jobs,
            "mapped_pages": pool.ledger.snapshot().mapped_pages,
        },
        "tokens": {k: d.tokens for k, d in drivers.items()},
    }
    print(json.dumps(result))
    if profilers:
        _print_profile_difference(profilers, args.steps)


def main() -> None:
    parser = workload_parser(__doc__, requests=256)
    parser.add_argument("--batched-tokens", type=int, default=8192)
    parser.add_argument("--page-size", default="2M", help="ELASTIC_KV_PAGE_SIZE of the elastic pool")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per scheduler")
    parser.add_argument("--warmup", type=int, default=40, help="untimed steps first (the prefills)")
    parser.add_argument("--slice", type=int, default=10, help="steps per alternating slice")
    parser.add_argument("--churn", action="store_true", help="replace finished requests (steady state)")
    parser.add_argument(
        "--bursts", type=int, default=0, help="instead of steps: N bursts from idle, alternating"
    )
    parser.add_argument("--async", dest="async_scheduling", action="store_true", help="async scheduling")
    parser.add_argument("--socket", action="store_true", help="reach the rank through its socket listener")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile both sides; print the functions that differ most"
    )
    parser.add_argument(
        "--calibrate", action="store_true", help="two native schedulers (A/A): the benchmark's own bias"
    )
    args = parser.parse_args()
    if not args.churn and args.steps + args.warmup > args.output:
        args.output = args.steps + args.warmup + 8  # no request finishes while timed: pure decode

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    native, _ = _scheduler(args, elastic=False)
    elastic, worker = _scheduler(args, elastic=not args.calibrate)
    hasher = get_request_block_hasher(BLOCK, sha256)
    drivers = {"native": Driver(native, args, hasher), "elastic": Driver(elastic, args, hasher)}
    try:
        if args.bursts:
            _bursts(drivers, args)
        else:
            _steps(drivers, args)
    finally:
        elastic.shutdown()
        if worker is not None:
            worker.close()


if __name__ == "__main__":
    main()
