"""GPU proof of vllm-elastic-kv on real hardware (vLLM 0.26 on the H200; vLLM from ci/gpu-bundle/).

Starts two engines on the GPU, one native and one with ``--kv-cache-backend=elastic``, each in a process of
its own, with CUDA graphs and torch.compile on (vLLM's defaults), and prints one summary:

* greedy outputs, elastic == native, token for token, on a batch of varied prompts;
* GPU memory each engine uses before / during / after a burst, from the driver's free-memory readings, and
  the pool's own snapshot -- an idle elastic engine must hold no more than the null block's page and its
  minimum reserve;
* throughput elastic / native on bursts from idle (goal >= 0.99): both engines stay up, and each round runs
  the same burst on one engine, then the other (alternating which goes first), while the other idles, so
  that the machine's drift -- a shared host's CPUs vary by tens of percent from one process or minute to
  the next -- hits both alike; the ratio is the median over rounds;
* the share of decode steps whose scheduling waited for a driver call (goal: none in steady state);
* engine start-up time, elastic - native, each compiling into fresh caches of its own (``--shared-caches``
  to let the second engine load what the first compiled; ``--cache-root DIR`` keeps each slot's caches for
  the next run, which loads what matches vLLM's cache keys instead of compiling it);
* a timeline of where the engine thread's time went in the bursts (:class:`_Timeline`).

What limits the throughput ratio's precision is the engine *process*, not the rounds: two native engines
(``--calibrate``, an A/A run) differ by several percent in engine-thread CPU time per burst, every phase
alike, although they run the same code on the same cores. The script fixes the address layout and hash
seed of both processes (the default: ``setarch -R``, ``PYTHONHASHSEED=0``; ``--random-layout`` keeps them
random), which narrows that difference without removing it: compare an A/B run with an A/A run made the
same way, or run A/B twice, the second time with ``--swap`` (elastic in the slot that starts second): the
geometric mean of the two ratios cancels whatever the slots themselves differ by. CPU cores (``--pin``):
by default both engines run on the same cores (one bursts while the other idles) and this script on cores
of its own; ``split`` gives each engine cores of its own; ``none`` pins nothing.

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: TP=1 uses vLLM's uni executor, so the
worker is in-process too) so the script can read the scheduler's pool and the worker's data plane directly;
both backends run that way. Neither loads plugins through vLLM (``VLLM_PLUGINS=""``, so the native run is pure
vLLM); the elastic run calls ``vllm_elastic_kv.register()`` itself, so ``packages/vllm-elastic-kv/src`` on
``PYTHONPATH`` is enough.

    python3 ci/gpu_vllm.py [--model tiny|1b|8b|gptoss|mla|gdn|moe] [--speculative ngram]
                           [--requests 256] [--prompt 256]
                           [--output 128] [--bursts 21] [--swap | --calibrate [native|elastic]]
                           [--gpu-times] [--out DIR]

Exit status 0 when every check holds, 1 otherwise. Writes ``gpu_vllm.json`` to ``--out`` (default $OUT).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import gc
import itertools
import json
import logging
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("gpu_vllm")
_MARK = "@@gpu_vllm "  # prefixes the children's protocol lines on stdout
_SLOTS = ("A", "B")  # the children's --child values; A starts first


def _backend(slot: str, args: argparse.Namespace) -> str:
    """The backend a slot runs: elastic in A (in B with ``--swap``), native in the other; with ``--calibrate
    [BACKEND]`` that backend in both (native by default)."""
    if args.calibrate:
        return str(args.calibrate)
    return "elastic" if slot == ("B" if args.swap else "A") else "native"


GREEDY_TOKENS = 64  # per prompt of the greedy comparison

ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}


# Llama shapes with random ("dummy") weights. tiny: 8 layers of 1024 -- the engine thread's Python work, not
# the GPU, sets the pace, which makes the plugin's per-step costs weigh the most (the worst case). 1b:
# TinyLlama-1.1B's shape (22 layers of 2048, 4 KV heads). 8b: Llama-3-8B's shape (32 layers of 4096, 8 KV
# heads; 16 GB of weights per engine) -- what an H200 serves, where the GPU sets the pace.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}


def _core_groups() -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (hyper-thread siblings together)."""
    allowed = sorted(os.sched_getaffinity(0))
    groups: dict[str, list[int]] = {}
    for cpu in allowed:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        except OSError:
            siblings = str(cpu)
        groups.setdefault(siblings.strip(), []).append(cpu)
    return sorted(groups.values())


def _cpu_split(mode: str) -> dict[str, list[int]] | None:
    """CPUs (whole physical cores) for each engine and for this process (see ``--pin``); None when pinning
    is off or there are too few cores to give each engine three."""
    cores = _core_groups()
    each = (len(cores) - 1) // 2
    if mode == "none" or each < 3:
        return None
    parts = (cores[:each], cores[each : 2 * each], cores[2 * each :])
    if mode == "shared":
        parts = (cores[: 2 * each], cores[: 2 * each], cores[2 * each :])
    first, second, parent = (sorted(c for core in part for c in core) for part in parts)
    return {"A": first, "B": second, "parent": parent}


# Other attention families (random weights; `--model NAME`): the KV cache groups vLLM builds beyond one plain
# full-attention group, each with a few layers of its real architecture's shape. gptoss: sliding-window and
# full attention, both with attention sinks, MoE (gpt-oss-20b's layer shape). mla: DeepSeek-V3's latent
# attention (kv_lora_rank 512, rope 64) with MoE. gdn: Qwen3-Next's Gated DeltaNet state beside full
# attention, MoE. moe: Qwen3-MoE (full attention; vLLM may pick another model runner for MoE models).
FAMILY_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gptoss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 4,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "mla": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "moe_intermediate_size": 1024,
            "num_hidden_layers": 4,
            "first_k_dense_replace": 1,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "n_routed_experts": 16,
            "n_shared_experts": 1,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
        },
    ),
    "gdn": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        },
    ),
    "moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 8,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 768,
            "num_experts": 32,
            "num_experts_per_tok": 4,
        },
    ),
}


# Speculative decoding (`--speculative NAME`): n-gram drafts, three tokens a step, verified by the target.
SPECULATIVE: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}


def _model_dir(root: Path, model: str) -> Path:
    import transformers

    path = root / f"{'llama-' if model in MODELS else ''}{model}"
    if (path / "config.json").exists():
        return path
    if model in FAMILY_MODELS:
        config_class, architecture, shape = FAMILY_MODELS[model]
        getattr(transformers, config_class)(
            architectures=[architecture], vocab_size=32000, max_position_embeddings=4096, **shape
        ).save_pretrained(path)
        return path
    transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=32000,
        max_position_embeddings=4096,
        **MODELS[model],
    ).save_pretrained(path)
    return path


def _prompts(n: int, length: int, salt: int) -> list[dict[str, list[int]]]:
    return [
        {"prompt_token_ids": [(7 * i + 13 * j + salt) % 31999 + 1 for j in range(length)]} for i in range(n)
    ]


class _Sampler:
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

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class _GcPauses:
    """Counts the garbage collector's pauses (all generations) while entered."""

    def __init__(self) -> None:
        self.seconds, self.count, self._t0 = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1

    def __enter__(self) -> _GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)


class _Timeline:
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


class _StepSpans:
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


def _memory_probe(cpu_smoke: bool) -> tuple[Any, Any, str]:
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


def _say(message: dict[str, Any]) -> None:
    """One protocol line to the parent (stdout also carries whatever else prints there)."""
    print(_MARK + json.dumps(message), flush=True)


def _child(args: argparse.Namespace) -> None:
    """One engine: set up, check, then run bursts on the parent's command (see :func:`main`)."""
    from vllm import LLM, SamplingParams

    mem_get_info, synchronize, device = _memory_probe(args.cpu_smoke)
    backend = _backend(args.child, args)
    if backend == "elastic":
        # What the entry point does; explicit, so that the plugin's source folder on PYTHONPATH suffices
        # on a machine where it was not pip-installed (idempotent when the entry point ran too).
        import vllm_elastic_kv

        vllm_elastic_kv.register()
        if args.socket:
            from vllm_elastic_kv.scheduler import scheduler_pool

            scheduler_pool.local_rank = lambda instance, rank: None  # type: ignore[assignment]
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
    # This engine's use = `base` + the drop of free memory since `free` was read. The other engine changes
    # its use only in its own bursts, and returns to its idle use after them; this one reads memory only
    # while the other idles: while it starts (base: its idle use), then in and after its own bursts, from
    # a reading just before each.
    reference = {"base": 0, "free": mem_get_info()[0]}
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        seed=0,
        **extra,
    )
    startup = time.perf_counter() - t0
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    pool = getattr(scheduler, "elastic_pool", None)
    worker_pool = getattr(core.model_executor.driver_worker.worker, "_elastic_pool", None)
    timeline = _Timeline()
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
    target = None  # what the worker's rank maps pages through (elastic only)
    if worker_pool is not None and worker_pool.rank is not None:
        # Whoever carries the requests (the mapper's thread directly, or a socket listener) calls this.
        timeline.wrap(worker_pool.rank, "dispatch", "elastic: rank applies requests (off the engine thread)")
        target = worker_pool.rank._pools[0].target
        if hasattr(target, "_zero"):  # the worker's _ZeroingTarget: where a map's time goes
            timeline.wrap(target, "map", "elastic: rank maps pages (driver and zeroing)", traced=True)
            timeline.wrap(target, "_zero", "elastic: rank zeroes new pages")
            timeline.wrap(target, "commit", "elastic: rank releases pages")
    spans = _StepSpans() if args.gpu_times else None
    if spans is not None:
        spans.wrap_engine(core.model_executor)
        if target is not None:
            spans.wrap_maps(target)

    def probe() -> dict[str, Any]:
        free, _ = mem_get_info()
        sample = {
            "t": time.perf_counter(),
            "used": reference["base"] + reference["free"] - free,
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
        }
        if pool is not None:
            sample.update(charged=pool.ledger.charged_bytes, steps=pool.steps, driver_steps=pool.driver_steps)
        return sample

    def drain() -> None:
        """Process the step still in flight, as vLLM's engine-core process does by itself: its busy loop
        runs while ``batch_queue`` is not empty (``EngineCore.has_work``). In-process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) ``LLM.generate`` returns once every request finished, and
        with async scheduling the step scheduled after the last output stays queued until the next
        request -- with it the pages it may still read, which the pool releases only after it."""
        while getattr(core, "batch_queue", None):
            core.step_fn()

    def idle(timeout: float = 20.0) -> dict[str, Any]:
        """Wait for the pool to settle (its releases run behind), then read memory."""
        drain()
        deadline = time.monotonic() + timeout
        last = probe()
        while pool is not None and time.monotonic() < deadline:
            time.sleep(0.5)
            now = probe()
            # the host's memory (--cpu-smoke) moves with every other process: the pool's charge only
            if now["charged"] == last["charged"] and (args.cpu_smoke or now["used"] == last["used"]):
                break
            last = now
        synchronize()
        return probe()

    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    lengths = [1, 7, 15, 16, 17, 31, 64, 100, 255, 256, 257, 511, 700, 1000, 1500, 1900]
    if args.cpu_smoke:  # checks the wiring, not the kernels: prompts up to just past two 128-token blocks
        lengths = [n for n in lengths if n <= 257]
    varied = [
        {"prompt_token_ids": [(5 * i + 3 * j) % 31999 + 1 for j in range(n)]} for i, n in enumerate(lengths)
    ]
    shared = [(11 * j) % 31999 + 1 for j in range(300)]
    varied += [
        {"prompt_token_ids": shared + [(17 * k + j) % 31999 + 1 for j in range(k)]} for k in (1, 40, 200)
    ]
    before = idle()
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(varied, greedy, use_tqdm=False)]
    burst_params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(_prompts(8, args.prompt, 1), burst_params, use_tqdm=False)  # warm-up
    settled = idle()
    reference.update(base=settled["used"], free=mem_get_info()[0])
    if args.gc_freeze:
        gc.collect()
        gc.freeze()  # what a long-running server does after start-up: older objects leave the collector
    _say({"event": "ready", "startup_s": round(startup, 2), "tokens": tokens})

    profiler = cProfile.Profile() if args.profile else None
    pauses = _GcPauses()
    sampler = _Sampler(probe)
    first_burst: list[dict[str, Any]] = []
    seconds, cpu, per_burst = 0.0, 0.0, []
    with sampler, pauses:
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] != "burst":
                break
            idle()  # each burst from idle: the elastic pool grows from its reserve every time
            reference["free"] = mem_get_info()[0]
            prompts = _prompts(args.requests, args.prompt, command["seed"])
            cpu0, t1 = time.thread_time(), time.perf_counter()
            timeline.begin(t1)
            sampler.active = True
            if spans is not None:
                spans.begin()
            with profiler or contextlib.nullcontext():
                outs = llm.generate(prompts, burst_params, use_tqdm=False)
            timeline.end()
            sampler.active = False
            if spans is not None:
                spans.end()
            took, cpu = time.perf_counter() - t1, cpu + time.thread_time() - cpu0
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            seconds += took
            per_burst.append(round(made / took, 1))
            if spans is not None:
                synchronize()
                spans.burst_done()
            if not first_burst:
                first_burst = list(sampler.samples)
            _say({"event": "burst", "tokens_per_s": per_burst[-1]})
    after = idle()  # (the other engine is still up and idle: the parent lets both exit together)
    if profiler is not None:
        with open(Path(args.out) / f"profile_{args.child}_{backend}.txt", "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(60)
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)

    result: dict[str, Any] = {
        "event": "done",
        "backend": backend,
        "device": device,
        "vllm": __import__("vllm").__version__,
        "burst_seconds": round(seconds, 3),
        "burst_tokens_per_s_each": per_burst,
        # Where the bursts' time went on the engine's thread: its own CPU time, and garbage collection.
        "burst_thread_cpu_s": round(cpu, 3),
        "burst_gc_s": round(pauses.seconds, 3),
        "burst_gc_collections": pauses.count,
        "gc_tracked_objects": len(gc.get_objects()),
        "timeline": timeline.report(),
        "gpu_step_times": spans.report() if spans is not None else None,
        "gpu_burst_edges": spans.edges_report() if spans is not None else None,
        "used_before": before["used"],
        "used_idle_before_burst": settled["used"],
        "used_max_during": max(s["used"] for s in sampler.samples),
        "used_after": after["used"],
    }
    if pool is not None:
        snap = pool.ledger.snapshot()
        full = [s for s in first_burst if s["waiting"] == 0 and s["running"] == args.requests]
        steady = (
            {
                "steps": full[-1]["steps"] - full[0]["steps"],
                "driver_steps": full[-1]["driver_steps"] - full[0]["driver_steps"],
            }
            if len(full) >= 2
            else {"steps": 0, "driver_steps": 0}
        )
        backend_calls = worker_pool.backend if worker_pool is not None else None
        result.update(
            page_bytes=snap.page_bytes,
            blocks_per_page=snap.blocks_per_page,
            total_blocks=snap.total_blocks,
            reserve_min_bytes=pool.reserve_min_pages * snap.page_bytes,
            reserve_max_bytes=pool.plugin.elastic.reserve_max_pages * snap.page_bytes,
            charged_before=before["charged"],
            charged_peak=max(s["charged"] for s in sampler.samples),
            charged_after=after["charged"],
            reserve_pages_after=snap.reserve_pages,
            steps_total=pool.steps,
            driver_steps_total=pool.driver_steps,
            steady_decode=steady,
            background_maps=pool.mapper.async_jobs,
            releases=pool.mapper.releases,
            reserve_hit_rate=round(snap.reserve_hit_rate, 3),
            driver_calls={op: backend_calls.calls(op) for op in ("create", "map", "unmap", "set_access")}
            if backend_calls is not None
            else {},
        )
    _say(result)
    sys.stdin.read()  # until the parent closes it: both engines exit only once both reported


class _Engine:
    """A child process running one backend's engine, driven line by line (see :func:`main`)."""

    def __init__(self, slot: str, args: argparse.Namespace) -> None:
        # The two children's command lines and environments differ in nothing but the slot's letter: their
        # sizes shift the process's address layout (see --random-layout).
        backend = _backend(slot, args)
        cmd = [sys.executable, __file__, "--child", slot, "--model-dir", args.model_dir]
        if args.same_layout and shutil.which("setarch"):
            # Two processes of one interpreter differed by 14 % in engine-thread CPU per burst with their
            # randomized address layout and hash seed (--calibrate, two native engines); fixed, 7 %.
            cmd = ["setarch", os.uname().machine, "-R", *cmd]
        cmd += ["--requests", str(args.requests), "--prompt", str(args.prompt), "--output", str(args.output)]
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        cmd += ["--cpu-smoke"] if args.cpu_smoke else []
        cmd += ["--profile", "--out", args.out] if args.profile else []
        cmd += ["--gc-freeze"] if args.gc_freeze else []
        cmd += ["--gpu-times"] if args.gpu_times else []
        cmd += ["--socket"] if args.socket else []
        cmd += ["--calibrate", args.calibrate] if args.calibrate else []
        cmd += ["--swap"] if args.swap else []
        cmd += ["--speculative", args.speculative] if args.speculative else []
        if args.cpu_split is not None:
            cmd += ["--cpus", ",".join(map(str, args.cpu_split[slot]))]
        self.backend = backend
        # By slot too: with --calibrate both children run one backend, and one log each must not be shared.
        self.log = Path(args.out) / f"gpu_vllm_{slot}_{backend}.log"
        env = {**os.environ, **ENV}
        if args.same_layout:
            env["PYTHONHASHSEED"] = "0"
        if args.own_caches:
            # Each engine compiles from nothing into caches of its own (same path length for both): a
            # compile cache left by the first would let the second load instead of compile, and so start
            # faster and run with other Python objects than the first.
            caches = Path(args.cache_root or Path(args.model_dir).parent) / f"caches-{slot}"
            env.update(
                VLLM_CACHE_ROOT=str(caches / "vllm"),
                TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                TRITON_CACHE_DIR=str(caches / "triton"),
            )
        # Pure vLLM loads no plugin; the elastic child registers the plugin itself (see _child).
        env["VLLM_PLUGINS"] = ""
        self._err = open(self.log, "w")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True
        )
        self.ready = self._receive("ready")
        logger.info("slot %s (%s) ready: started in %.1f s", slot, backend, self.ready["startup_s"])

    def _receive(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                message: dict[str, Any] = json.loads(line[len(_MARK) :])
                if message.get("event") == event:
                    return message
        self.proc.wait()
        print(f"{self.backend} engine failed; last lines of {self.log}:", file=sys.stderr)
        print("".join(self.log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        raise SystemExit(1)

    def _send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def burst(self, seed: int) -> float:
        self._send(cmd="burst", seed=seed)
        return float(self._receive("burst")["tokens_per_s"])

    def finish(self) -> dict[str, Any]:
        """The engine's report; it keeps its memory until :meth:`close`."""
        self._send(cmd="finish")
        return {**self.ready, **self._receive("done")}

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()
        self._err.close()


def _per_burst(result: dict[str, Any], key: str) -> str:
    """Milliseconds per burst that the timeline counted under ``key``: wall, CPU, calls."""
    entry = result["timeline"].get(key, {"s": 0.0, "cpu_s": 0.0, "calls": 0})
    bursts = len(result["burst_tokens_per_s_each"])
    wall, cpu = 1000 * entry["s"] / bursts, 1000 * entry["cpu_s"] / bursts
    phases = ""
    if "phased_s" in entry:
        edges = [0.0, *_Timeline.PHASES]
        labels = [f"{lo:g}-{hi:g} s" for lo, hi in itertools.pairwise(edges)] + [f"after {edges[-1]:g} s"]
        phases = "; by start in the burst: " + ", ".join(
            f"{label} {1000 * s / bursts:.1f}" for label, s in zip(labels, entry["phased_s"], strict=True)
        )
    if "first_last_s" in entry:
        first, last = (1000 * s / bursts for s in entry["first_last_s"])
        phases += f"; first {first:.1f}, last {last:.1f}"
    return f"{wall:.1f} (cpu {cpu:.1f}, {entry['calls'] // bursts} calls{phases})"


def _phases(native: dict[str, Any], elastic: dict[str, Any], keys: tuple[str, ...]) -> str:
    """``key native / elastic`` per burst for each timeline ``key`` (see :func:`_per_burst`)."""
    return ", ".join(f"{key} {_per_burst(native, key)} / {_per_burst(elastic, key)}" for key in keys)


def _calibration_line(backend: str, ratios: list[float], a: dict[str, Any], b: dict[str, Any]) -> str:
    """The A/A result (``--calibrate``): slot A's throughput over slot B's, by round and over the whole run,
    and where each slot's engine thread spent its time per burst (``a``, ``b``: the slots' reports)."""
    listed = ", ".join(f"{x:.3f}" for x in ratios)
    total = b["burst_seconds"] / a["burst_seconds"]  # same tokens on both: a throughput ratio
    return (
        f"A/A (two {backend} engines): ratio slot A / slot B: median {statistics.median(ratios):.4f}, "
        f"mean {statistics.fmean(ratios):.4f}, total time {total:.4f} ({listed}); engine-thread CPU "
        f"{a['burst_thread_cpu_s']} / {b['burst_thread_cpu_s']} s; per burst "
        + _phases(a, b, ("schedule", "execute", "execute: sample", "update"))
    )


def _other(result: dict[str, Any]) -> str:
    """Milliseconds per burst outside the engine core's phases (LLM.generate's own work: inputs, outputs)."""
    phases = sum(result["timeline"][k]["s"] for k in ("schedule", "execute", "execute: sample", "update"))
    bursts = len(result["burst_tokens_per_s_each"])
    return f"{1000 * (result['burst_seconds'] - phases) / bursts:.1f}"


def _step_times(native: dict[str, Any], elastic: dict[str, Any]) -> list[str]:
    """The ``--gpu-times`` lines: mean GPU span and idle gap before it, per kind of step (none without)."""
    if not native.get("gpu_step_times"):
        return []
    lines = ["GPU time per step (CUDA events; span: first kernel to sampler's end, gap: GPU idle before it):"]
    for name, result in (("native", native), ("elastic", elastic)):
        for kind, t in result["gpu_step_times"].items():
            lines.append(
                f"  {name:7s} {kind:23s} {t['steps']:6d} steps, span {t['span_ms']:.3f} ms, "
                f"gap {t['gap_ms']:.3f} ms"
            )
    lines.append("A burst's edges, ms (lead: generate() called to the first step's start; tail: the last")
    lines.append("  sampler's end to generate()'s return; the GPU idles in both):")
    for name, result in (("native", native), ("elastic", elastic)):
        edges = result.get("gpu_burst_edges") or {}
        lines.append(
            f"  {name:7s} lead {edges.get('lead_ms', 0.0):.3f}, "
            f"first step's span {edges.get('first_ms', 0.0):.3f}, tail {edges.get('tail_ms', 0.0):.3f}"
        )
    return lines


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--bursts", type=int, default=21, help="rounds: bursts per engine (median taken)")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS) + sorted(FAMILY_MODELS),
        default="tiny",
        help="model shape (random weights): Llama shapes, or another attention family (FAMILY_MODELS)",
    )
    parser.add_argument(
        "--speculative",
        choices=sorted(SPECULATIVE),
        help="both engines decode speculatively with these drafts (the elastic backend serves ngram)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.30)
    parser.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=_SLOTS, help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the bursts; write profile_<slot>_<backend>.txt to --out",
    )
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the bursts")
    parser.add_argument(
        "--no-speed-goal",
        action="store_true",
        help="report the throughput ratio without checking it (a correctness run: small bursts are noise)",
    )
    parser.add_argument(
        "--gpu-times",
        action="store_true",
        help="time each burst step on the GPU (CUDA events): decode and prefill spans and the idle gaps "
        "between steps, elastic split by whether its rank was mapping (not with --cpu-smoke)",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="check this script on a CPU-only machine")
    parser.add_argument(
        "--pin", choices=["shared", "split", "none"], default="shared", help="CPU cores of the engines"
    )
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    parser.add_argument(
        "--socket", action="store_true", help="reach the worker's rank through its socket, not directly"
    )
    parser.add_argument(
        "--calibrate",
        nargs="?",
        const="native",
        choices=["native", "elastic"],
        help="A/A: two engines of one backend (native unless given), to measure what the slots differ by",
    )
    parser.add_argument(
        "--swap",
        action="store_true",
        help="elastic in the second slot (native starts first): run with and without to cancel what the "
        "slots themselves differ by",
    )
    parser.add_argument(
        "--shared-caches",
        dest="own_caches",
        action="store_false",
        help="let the engines share vLLM's, inductor's and Triton's caches (by default each has its own)",
    )
    parser.add_argument(
        "--cache-root",
        help="keep each slot's compile caches under this folder, for the next run (default: a fresh one)",
    )
    parser.add_argument(
        "--random-layout",
        dest="same_layout",
        action="store_false",
        help="keep address-space randomization and random hash seeds (by default both engines run without)",
    )
    args = parser.parse_args()
    if args.swap and args.calibrate:
        parser.error("--calibrate runs one backend in both slots; --swap has nothing to swap")
    if args.gpu_times and args.cpu_smoke:
        parser.error("--gpu-times reads CUDA events: it needs a GPU")
    if args.child:
        if args.cpus:  # before vLLM and torch start their threads: they inherit it
            os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
        _child(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    split = _cpu_split(args.pin)
    args.cpu_split = split
    if split is not None:
        os.sched_setaffinity(0, split["parent"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.model_dir = str(_model_dir(Path(tempfile.mkdtemp(prefix="ekv-gpu-")), args.model))
    # Slot A starts first (elastic, unless --swap): with --shared-caches, what the first engine compiles
    # shortens the second's start-up.
    first, second = _Engine("A", args), _Engine("B", args)
    elastic_engine, native_engine = (second, first) if args.swap else (first, second)
    rounds: list[tuple[float, float]] = []
    for r in range(args.bursts):
        # Both engines are up; one bursts while the other idles. Alternating which goes first, each round's
        # pair runs back to back on the same prompts, so the machine's drift hits both alike.
        if r % 2:
            e, n = elastic_engine.burst(2 + r), native_engine.burst(2 + r)
        else:
            n, e = native_engine.burst(2 + r), elastic_engine.burst(2 + r)
        rounds.append((n, e))
        # As it goes: a run cut short by a time limit still says how far it got.
        logger.info(
            "round %d/%d: native %.0f tok/s, elastic %.0f tok/s, ratio %.4f", r + 1, args.bursts, n, e, e / n
        )
    elastic, native = elastic_engine.finish(), native_engine.finish()
    elastic_engine.close()
    native_engine.close()

    ratios = [e / n for n, e in rounds]
    if args.calibrate:
        # Under --calibrate both slots run one backend; `elastic_engine` is slot A (no --swap).
        print(_calibration_line(args.calibrate, ratios, elastic, native), flush=True)
        return
    ratio, mean = statistics.median(ratios), statistics.fmean(ratios)
    total = native["burst_seconds"] / elastic["burst_seconds"]  # same tokens on both: a throughput ratio
    listed = ", ".join(f"{x:.3f}" for x in ratios)
    same = native["tokens"] == elastic["tokens"]
    # The spread of the rounds, as a 95 % interval of their mean (normal approximation): a ratio goal
    # closer to the median than this is within the machine's noise.
    spread = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    # Idle, the pool backs the null block's page and its minimum reserve, nothing more.
    idle_ok = elastic["charged_after"] <= elastic["page_bytes"] + elastic["reserve_min_bytes"]
    steady = elastic["steady_decode"]
    share = steady["driver_steps"] / steady["steps"] if steady["steps"] else float("nan")
    checks = {
        "greedy outputs equal": same,
        "idle footprint <= null page + minimum reserve": idle_ok,
        "no driver call in steady decode": steady["steps"] > 0 and steady["driver_steps"] == 0,
    }
    if not args.no_speed_goal:
        checks["throughput ratio >= 0.99"] = ratio >= 0.99
    lines = [
        f"vLLM {elastic['vllm']} on {elastic['device']}",
        f"greedy outputs: {'EQUAL' if same else 'DIFFERENT'} "
        f"({len(native['tokens'])} prompts x {GREEDY_TOKENS} tokens)",
        "GPU memory each engine uses (driver free-memory readings; the other engine idle meanwhile):",
        f"  native : idle {_gib(native['used_idle_before_burst'])}, max in a burst "
        f"{_gib(native['used_max_during'])}, after {_gib(native['used_after'])}",
        f"  elastic: idle {_gib(elastic['used_idle_before_burst'])}, max in a burst "
        f"{_gib(elastic['used_max_during'])}, after {_gib(elastic['used_after'])}",
        f"  elastic idle saves {_gib(native['used_idle_before_burst'] - elastic['used_idle_before_burst'])}"
        f" versus native; grows by {_gib(elastic['used_max_during'] - elastic['used_idle_before_burst'])}"
        " in a burst",
        "KV memory (pool snapshot): backed before "
        f"{_gib(elastic['charged_before'])}, peak {_gib(elastic['charged_peak'])}, after "
        f"{_gib(elastic['charged_after'])} (minimum reserve {_gib(elastic['reserve_min_bytes'])}, "
        f"reserve cap {_gib(elastic['reserve_max_bytes'])}, page "
        f"{elastic['page_bytes'] >> 20} MiB = {elastic['blocks_per_page']} blocks)",
        f"throughput: elastic / native {ratio:.4f} (median of {len(rounds)} rounds, each a burst on both "
        f"engines back to back: {listed}); mean {mean:.4f} +- {spread:.4f} (95 %); over all rounds "
        f"{total:.4f} (same tokens, total time); tok/s native "
        f"{[round(n) for n, _ in rounds]}, elastic {[round(e) for _, e in rounds]}",
        f"decode steps that waited for the driver: {steady['driver_steps']}/{steady['steps']} in steady "
        f"decode ({share:.2%}); {elastic['driver_steps_total']}/{elastic['steps_total']} over the whole run; "
        f"{elastic['background_maps']} background pre-maps, {elastic['releases']} releases behind; reserve "
        f"hit rate {elastic['reserve_hit_rate']}",
        f"driver calls (elastic worker): {elastic['driver_calls']}",
        "engine thread in the bursts (native / elastic): wall "
        f"{native['burst_seconds']} / {elastic['burst_seconds']} s, CPU {native['burst_thread_cpu_s']} / "
        f"{elastic['burst_thread_cpu_s']} s, garbage collection {native['burst_gc_s']} / "
        f"{elastic['burst_gc_s']} s ({native['burst_gc_collections']} / {elastic['burst_gc_collections']} "
        f"pauses; {native['gc_tracked_objects']} / {elastic['gc_tracked_objects']} tracked objects)",
        "time per burst (native / elastic, ms): "
        + _phases(
            native, elastic, ("schedule", "schedule: allocate_slots", "execute", "execute: sample", "update")
        )
        + f", other {_other(native)} / {_other(elastic)}",
        *(f"  {k}: {_per_burst(elastic, k)} ms" for k in elastic["timeline"] if k.startswith("elastic")),
        f"slots: elastic in {'B, native in A' if args.swap else 'A, native in B'} (A starts first); CPUs: "
        + (
            ", ".join(f"{k} {v}" for k, v in args.cpu_split.items())
            if args.cpu_split
            else f"not pinned ({os.cpu_count()})"
        ),
        f"start-up: native {native['startup_s']} s, elastic {elastic['startup_s']} s, "
        f"delta {elastic['startup_s'] - native['startup_s']:+.2f} s",
        *_step_times(native, elastic),
        "checks: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in checks.items()),
    ]
    print("\n".join(lines), flush=True)
    (Path(args.out) / "gpu_vllm.json").write_text(
        json.dumps({"native": native, "elastic": elastic, "checks": checks})
    )
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
