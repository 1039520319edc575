"""GPU proof of vllm-elastic-kv on real hardware (vLLM 0.26 on the H200; see ../shared/RECIPES.md).

Runs the same workload natively and with ``--kv-cache-backend=elastic``, each in a fresh process, with CUDA
graphs and torch.compile on (vLLM's defaults), and prints one summary:

* greedy outputs, elastic == native, token for token, on a batch of varied prompts;
* KV memory before / during / after a burst, from the driver's free-memory readings and the pool's own
  snapshot -- an idle elastic engine must hold no more than its reserve;
* throughput elastic / native on the burst (goal >= 0.99);
* the share of decode steps whose scheduling waited for a driver call (goal: none in steady state);
* engine start-up time, elastic - native.

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: TP=1 uses vLLM's uni executor, so the
worker is in-process too) so the script can read the scheduler's pool and the worker's data plane directly;
both backends run that way. The native run excludes the plugin (``VLLM_PLUGINS=""``); the elastic run calls
``vllm_elastic_kv.register()`` itself, so ``packages/vllm-elastic-kv/src`` on ``PYTHONPATH`` is enough.

    python3 ci/gpu_vllm.py [--requests 256] [--prompt 256] [--output 128] [--out DIR]

Exit status 0 when every check holds, 1 otherwise. Writes ``gpu_vllm.json`` to ``--out`` (default $OUT).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}


def _model_dir(root: Path) -> Path:
    from transformers import LlamaConfig

    path = root / "tiny-llama-8l"
    if not (path / "config.json").exists():
        LlamaConfig(
            architectures=["LlamaForCausalLM"],
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=4096,
        ).save_pretrained(path)
    return path


def _prompts(n: int, length: int, salt: int) -> list[dict[str, list[int]]]:
    return [
        {"prompt_token_ids": [(7 * i + 13 * j + salt) % 31999 + 1 for j in range(length)]} for i in range(n)
    ]


class _Sampler:
    """Reads the driver's free memory (and the elastic pool's counters) every ``period`` seconds."""

    def __init__(self, probe: Any, period: float = 0.02) -> None:
        self.samples: list[dict[str, Any]] = []
        self._probe = probe
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
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
    hooks, the scheduler thread's waits for the driver (synchronous maps, background maps it needs now),
    and the worker rank's request handling on the rank's listener thread. Wall well above CPU means the
    thread waited: for the GPU, the driver, or the interpreter lock.
    """

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, list[float]] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, obj: Any, name: str, key: str) -> None:
        inner = getattr(obj, name)
        spent, calls = [0.0, 0.0], self.calls
        self.seconds[key], calls[key] = spent, 0

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
                spent[1] += time.thread_time() - c0
                calls[key] += 1

        setattr(obj, name, timed)

    def report(self) -> dict[str, dict[str, float]]:
        return {
            k: {"s": round(wall, 4), "cpu_s": round(cpu, 4), "calls": self.calls[k]}
            for k, (wall, cpu) in self.seconds.items()
        }


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


def _child(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    mem_get_info, synchronize, device = _memory_probe(args.cpu_smoke)
    backend = args.child
    if backend == "elastic":
        # What the entry point does; explicit, so that the plugin's source folder on PYTHONPATH suffices
        # on a machine where it was not pip-installed (idempotent when the entry point ran too).
        import vllm_elastic_kv

        vllm_elastic_kv.register()
    extra: dict[str, Any] = (
        {"additional_config": {"kv_cache_backend": "elastic"}} if backend == "elastic" else {}
    )
    if args.cpu_smoke:
        extra.update(enforce_eager=True, dtype="float32", kv_cache_memory_bytes=256 << 20)
    else:
        extra.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization)
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
    timeline.wrap(scheduler, "schedule", "schedule")
    timeline.wrap(core.model_executor, "execute_model", "execute")
    timeline.wrap(core.model_executor, "sample_tokens", "execute: sample")
    timeline.wrap(scheduler, "update_from_output", "update")
    timeline.wrap(scheduler.kv_cache_manager, "allocate_slots", "schedule: allocate_slots")
    if pool is not None:
        timeline.wrap(pool, "step_dispatched", "elastic: step_dispatched (in schedule)")
        timeline.wrap(pool, "step_completed", "elastic: step_completed (in update)")
        timeline.wrap(pool.mapper, "map", "elastic: scheduler thread waits for map")
        timeline.wrap(pool.mapper, "unmap", "elastic: scheduler thread waits for unmap")
        timeline.wrap(pool.mapper, "collect", "elastic: scheduler thread collects background maps")
    if worker_pool is not None and worker_pool.rank is not None:
        timeline.wrap(worker_pool.rank, "handle", "elastic: rank requests (listener thread)")

    def probe() -> dict[str, Any]:
        free, _ = mem_get_info()
        sample = {
            "t": time.perf_counter(),
            "free": free,
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
        """Wait for the pool to settle (idle housekeeping shrinks the reserve), then read memory."""
        drain()
        deadline = time.monotonic() + timeout
        last = probe()
        while pool is not None and time.monotonic() < deadline:
            time.sleep(0.5)
            now = probe()
            if now["charged"] == last["charged"]:
                break
            last = now
        synchronize()
        return probe()

    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)
    varied = [
        {"prompt_token_ids": [(5 * i + 3 * j) % 31999 + 1 for j in range(n)]}
        for i, n in enumerate([1, 7, 15, 16, 17, 31, 64, 100, 255, 256, 257, 511, 700, 1000, 1500, 1900])
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
    # Several bursts, each from idle (the elastic pool grows from its reserve every time): the ratio is
    # that of the median bursts, so that a noisy burst (GPU clocks, the host) weighs little.
    if args.gc_freeze:
        gc.collect()
        gc.freeze()  # what a long-running server does after start-up: older objects leave the collector
    seconds, out_tokens, per_burst = 0.0, 0, []
    profiler = cProfile.Profile() if args.profile else None
    pauses = _GcPauses()
    cpu0 = time.thread_time()
    with _Sampler(probe) as sampler, pauses, profiler or contextlib.nullcontext():
        for seed in range(2, 2 + args.bursts):
            if seed == 3:
                first_burst = list(sampler.samples)
                idle()
            t1 = time.perf_counter()
            timeline.on = True
            outs = llm.generate(_prompts(args.requests, args.prompt, seed), burst_params, use_tqdm=False)
            timeline.on = False
            took = time.perf_counter() - t1
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            seconds, out_tokens = seconds + took, out_tokens + made
            per_burst.append(round(made / took, 1))
    after = idle()
    if profiler is not None:
        with open(Path(args.out) / f"profile_{backend}.txt", "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(60)
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)

    result: dict[str, Any] = {
        "backend": backend,
        "device": device,
        "vllm": __import__("vllm").__version__,
        "startup_s": round(startup, 2),
        "tokens": tokens,
        "burst_seconds": round(seconds, 3),
        "burst_tokens_per_s": round(out_tokens / seconds, 1),
        "burst_tokens_per_s_each": per_burst,
        "burst_tokens_per_s_median": statistics.median(per_burst),
        # Where the bursts' time went on the engine's thread: its own CPU time, and garbage collection.
        "burst_thread_cpu_s": round(time.thread_time() - cpu0, 3),
        "burst_gc_s": round(pauses.seconds, 3),
        "burst_gc_collections": pauses.count,
        "gc_tracked_objects": len(gc.get_objects()),
        "timeline": timeline.report(),
        "free_before": before["free"],
        "free_idle_before_burst": settled["free"],
        "free_min_during": min(s["free"] for s in sampler.samples),
        "free_after": after["free"],
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
            reserve_max_bytes=pool.plugin.elastic.reserve_max_pages * snap.page_bytes,
            charged_before=before["charged"],
            charged_peak=max(s["charged"] for s in sampler.samples),
            charged_after=after["charged"],
            reserve_pages_after=snap.reserve_pages,
            steps_total=pool.steps,
            driver_steps_total=pool.driver_steps,
            steady_decode=steady,
            background_maps=pool.mapper.async_jobs,
            reserve_hit_rate=round(snap.reserve_hit_rate, 3),
            driver_calls={op: backend_calls.calls(op) for op in ("create", "map", "unmap", "set_access")}
            if backend_calls is not None
            else {},
        )
    return result


def _run(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", backend, "--model-dir", args.model_dir]
    cmd += ["--requests", str(args.requests), "--prompt", str(args.prompt), "--output", str(args.output)]
    cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization), "--bursts", str(args.bursts)]
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    cmd += ["--profile", "--out", args.out] if args.profile else []
    cmd += ["--gc-freeze"] if args.gc_freeze else []
    log = Path(args.out) / f"gpu_vllm_{backend}.log"
    env = {**os.environ, **ENV}
    if backend == "native":
        env["VLLM_PLUGINS"] = ""  # pure vLLM: the plugin is not even loaded
    with open(log, "w") as err:
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    if done.returncode != 0:
        print(f"{backend} run failed; last lines of {log}:", file=sys.stderr)
        print("".join(log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        raise SystemExit(1)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _per_burst(result: dict[str, Any], key: str) -> str:
    """Milliseconds per burst that the timeline counted under ``key``: wall, CPU, calls."""
    entry = result["timeline"].get(key, {"s": 0.0, "cpu_s": 0.0, "calls": 0})
    bursts = len(result["burst_tokens_per_s_each"])
    wall, cpu = 1000 * entry["s"] / bursts, 1000 * entry["cpu_s"] / bursts
    return f"{wall:.1f} (cpu {cpu:.1f}, {entry['calls'] // bursts} calls)"


def _other(result: dict[str, Any]) -> str:
    """Milliseconds per burst outside the engine core's phases (LLM.generate's own work: inputs, outputs)."""
    phases = sum(result["timeline"][k]["s"] for k in ("schedule", "execute", "execute: sample", "update"))
    bursts = len(result["burst_tokens_per_s_each"])
    return f"{1000 * (result['burst_seconds'] - phases) / bursts:.1f}"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--bursts", type=int, default=5, help="timed bursts per backend (median taken)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.30)
    parser.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=["native", "elastic"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the bursts; write profile_<backend>.txt to --out"
    )
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the bursts")
    parser.add_argument("--cpu-smoke", action="store_true", help="check this script on a CPU-only machine")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)), flush=True)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.model_dir = str(_model_dir(Path(tempfile.mkdtemp(prefix="ekv-gpu-"))))
    native = _run("native", args)
    elastic = _run("elastic", args)

    same = native["tokens"] == elastic["tokens"]
    ratio = elastic["burst_tokens_per_s_median"] / native["burst_tokens_per_s_median"]
    idle_ok = elastic["charged_after"] <= elastic["page_bytes"] + elastic["reserve_max_bytes"]
    steady = elastic["steady_decode"]
    share = steady["driver_steps"] / steady["steps"] if steady["steps"] else float("nan")
    checks = {
        "greedy outputs equal": same,
        "idle footprint <= reserve": idle_ok,
        "throughput ratio >= 0.99": ratio >= 0.99,
        "no driver call in steady decode": steady["steps"] > 0 and steady["driver_steps"] == 0,
    }
    lines = [
        f"vLLM {elastic['vllm']} on {elastic['device']}",
        f"greedy outputs: {'EQUAL' if same else 'DIFFERENT'} ({len(native['tokens'])} prompts x 64 tokens)",
        "KV memory (driver free-memory readings, GPU-wide):",
        f"  native : idle free {_gib(native['free_idle_before_burst'])}, min during burst "
        f"{_gib(native['free_min_during'])}, after {_gib(native['free_after'])}",
        f"  elastic: idle free {_gib(elastic['free_idle_before_burst'])}, min during burst "
        f"{_gib(elastic['free_min_during'])}, after {_gib(elastic['free_after'])}",
        f"  elastic idle saves {_gib(elastic['free_idle_before_burst'] - native['free_idle_before_burst'])}"
        f" versus native; grows by {_gib(elastic['free_idle_before_burst'] - elastic['free_min_during'])}"
        " in the burst",
        "KV memory (pool snapshot): backed before "
        f"{_gib(elastic['charged_before'])}, peak {_gib(elastic['charged_peak'])}, after "
        f"{_gib(elastic['charged_after'])} (reserve cap {_gib(elastic['reserve_max_bytes'])}, page "
        f"{elastic['page_bytes'] >> 20} MiB = {elastic['blocks_per_page']} blocks)",
        f"throughput (median of {args.bursts} bursts): native {native['burst_tokens_per_s_median']} tok/s, "
        f"elastic {elastic['burst_tokens_per_s_median']} tok/s, ratio {ratio:.4f} (per burst: native "
        f"{native['burst_tokens_per_s_each']}, elastic {elastic['burst_tokens_per_s_each']})",
        f"decode steps that waited for the driver: {steady['driver_steps']}/{steady['steps']} in steady "
        f"decode ({share:.2%}); {elastic['driver_steps_total']}/{elastic['steps_total']} over the whole run; "
        f"{elastic['background_maps']} background pre-maps; reserve hit rate {elastic['reserve_hit_rate']}",
        f"driver calls (elastic worker): {elastic['driver_calls']}",
        "engine thread in the bursts (native / elastic): wall "
        f"{native['burst_seconds']} / {elastic['burst_seconds']} s, CPU {native['burst_thread_cpu_s']} / "
        f"{elastic['burst_thread_cpu_s']} s, garbage collection {native['burst_gc_s']} / "
        f"{elastic['burst_gc_s']} s ({native['burst_gc_collections']} / {elastic['burst_gc_collections']} "
        f"pauses; {native['gc_tracked_objects']} / {elastic['gc_tracked_objects']} tracked objects)",
        "time per burst (native / elastic, ms): "
        + ", ".join(
            f"{key} {_per_burst(native, key)} / {_per_burst(elastic, key)}"
            for key in ("schedule", "schedule: allocate_slots", "execute", "execute: sample", "update")
        )
        + f", other {_other(native)} / {_other(elastic)}",
        *(f"  {k}: {_per_burst(elastic, k)} ms" for k in elastic["timeline"] if k.startswith("elastic")),
        f"start-up: native {native['startup_s']} s, elastic {elastic['startup_s']} s, "
        f"delta {elastic['startup_s'] - native['startup_s']:+.2f} s",
        "checks: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in checks.items()),
    ]
    print("\n".join(lines), flush=True)
    (Path(args.out) / "gpu_vllm.json").write_text(
        json.dumps({"native": native, "elastic": elastic, "checks": checks})
    )
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
