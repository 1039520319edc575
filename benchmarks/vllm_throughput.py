"""Throughput of vLLM with the elastic KV cache divided by native vLLM, same workload, one run (not a test).

Each measurement is a fresh interpreter (one engine per process, engine core and worker in it, nothing
shared); native and elastic alternate for ``--rounds`` rounds and each backend's best round counts. On a
shared machine wall-clock throughput swings by 2x with other people's jobs, so the summary also gives
the ratio of tokens per CPU-second of the engine process (all its threads), which those swings affect
far less. The native runs exclude the plugin entirely (``VLLM_PLUGINS=""``).

    python benchmarks/vllm_throughput.py [--rounds 2] [--requests 64] [--prompt 256] [--output 128]

Prints one JSON line per measurement and a summary: output tokens/s for each backend, the ratio
elastic / native (goal >= 0.99), engine start-up time, and for elastic the pool's statistics (steps, steps
whose window reached the workers' driver, reserve hit rate, peak backed bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workload import workload_parser  # noqa: E402


def _child(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from tests.support.models import tiny_vllm_args

    extra = {"additional_config": {"kv_cache_backend": "elastic"}} if args.child == "elastic" else {}
    start = time.perf_counter()
    llm = LLM(
        **tiny_vllm_args(max_model_len=2048, kv_cache_memory_bytes=args.capacity << 20, seed=0, **extra)
    )
    started = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(args.prompt)]}
        for i in range(args.requests)
    ]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result: dict[str, Any] = {
        "backend": args.child,
        "startup_s": round(started, 2),
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "cpu_seconds": round(cpu_seconds, 3),
        "tokens_per_cpu_s": round(tokens / cpu_seconds, 1),
    }
    if args.child == "elastic":
        core = llm.llm_engine.engine_core.engine_core  # in-process engine core (see main)
        pool = core.scheduler.elastic_pool
        snap = pool.ledger.snapshot()
        result.update(
            steps=pool.steps,
            driver_steps=pool.driver_steps,
            reserve_hit_rate=round(snap.reserve_hit_rate, 3),
            page_bytes=snap.page_bytes,
        )
    llm.llm_engine.engine_core.shutdown()
    return result


def _measure(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if backend == "native":
        env["VLLM_PLUGINS"] = ""
    cmd = [sys.executable, __file__, "--child", backend]
    cmd += ["--requests", str(args.requests), "--prompt", str(args.prompt), "--output", str(args.output)]
    cmd += ["--capacity", str(args.capacity)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{backend} run failed")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = workload_parser(__doc__, requests=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=256, help="KV cache capacity, MiB")
    parser.add_argument("--child", choices=["native", "elastic"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)), flush=True)
        return
    runs: dict[str, list[dict[str, Any]]] = {"native": [], "elastic": []}
    for _ in range(args.rounds):
        for backend in ("native", "elastic"):
            run = _measure(backend, args)
            runs[backend].append(run)
            print(json.dumps(run), flush=True)
    best = {b: max(r["tokens_per_s"] for r in rs) for b, rs in runs.items()}
    cpu = {b: max(r["tokens_per_cpu_s"] for r in rs) for b, rs in runs.items()}
    summary = {
        "native_tokens_per_s": best["native"],
        "elastic_tokens_per_s": best["elastic"],
        "ratio": round(best["elastic"] / best["native"], 4),
        "ratio_per_cpu_second": round(cpu["elastic"] / cpu["native"], 4),
        "startup_delta_s": round(
            min(r["startup_s"] for r in runs["elastic"]) - min(r["startup_s"] for r in runs["native"]), 2
        ),
        "elastic_driver_steps": [f"{r['driver_steps']}/{r['steps']}" for r in runs["elastic"]],
    }
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
