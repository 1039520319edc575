"""The GPU proof's report: the summary it prints (memory, throughput, driver waits, where the engine
thread's time went, start-up, the checks), the A/A line of ``--calibrate``, and ``gpu_vllm.json``."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.gpu_vllm import throughput
from benchmarks.gpu_vllm.models import GREEDY_TOKENS
from benchmarks.gpu_vllm.timeline import Timeline


def _per_burst(result: dict[str, Any], key: str) -> str:
    """Milliseconds per burst that the timeline counted under ``key``: wall, CPU, calls."""
    entry = result["timeline"].get(key, {"s": 0.0, "cpu_s": 0.0, "calls": 0})
    bursts = len(result["burst_tokens_per_s_each"])
    wall, cpu = 1000 * entry["s"] / bursts, 1000 * entry["cpu_s"] / bursts
    phases = ""
    if "phased_s" in entry:
        edges = [0.0, *Timeline.PHASES]
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


def calibration_line(backend: str, ratios: list[float], a: dict[str, Any], b: dict[str, Any]) -> str:
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


def summary(
    args: argparse.Namespace,
    native: dict[str, Any],
    elastic: dict[str, Any],
    rounds: list[tuple[float, float]],
    checks: dict[str, bool],
) -> str:
    """The summary printed at the end of a run (not under ``--calibrate``)."""
    lines = [
        f"vLLM {elastic['vllm']} on {elastic['device']}",
        f"greedy outputs: {'EQUAL' if checks['greedy outputs equal'] else 'DIFFERENT'} "
        f"({len(native['tokens'])} prompts x {GREEDY_TOKENS} tokens)",
        *_memory_lines(native, elastic),
        _throughput_line(native, elastic, rounds),
        *_driver_lines(elastic),
        *_engine_thread_lines(native, elastic),
        *_set_up_lines(args, native, elastic),
        *_step_times(native, elastic),
        "checks: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in checks.items()),
    ]
    return "\n".join(lines)


def _memory_lines(native: dict[str, Any], elastic: dict[str, Any]) -> list[str]:
    """GPU memory each engine uses (driver readings), then the elastic pool's own snapshot."""
    return [
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
    ]


def _throughput_line(
    native: dict[str, Any], elastic: dict[str, Any], rounds: list[tuple[float, float]]
) -> str:
    """Elastic / native: the median of the rounds, their mean and spread, and the ratio over all rounds."""
    each = throughput.ratios(rounds)
    ratio, mean, spread = statistics.median(each), statistics.fmean(each), throughput.spread(each)
    total = native["burst_seconds"] / elastic["burst_seconds"]  # same tokens on both: a throughput ratio
    listed = ", ".join(f"{x:.3f}" for x in each)
    return (
        f"throughput: elastic / native {ratio:.4f} (median of {len(rounds)} rounds, each a burst on both "
        f"engines back to back: {listed}); mean {mean:.4f} +- {spread:.4f} (95 %); over all rounds "
        f"{total:.4f} (same tokens, total time); tok/s native "
        f"{[round(n) for n, _ in rounds]}, elastic {[round(e) for _, e in rounds]}"
    )


def _driver_lines(elastic: dict[str, Any]) -> list[str]:
    """Decode steps that waited for the driver, and the elastic worker's driver calls."""
    steady = elastic["steady_decode"]
    share = steady["driver_steps"] / steady["steps"] if steady["steps"] else float("nan")
    return [
        f"decode steps that waited for the driver: {steady['driver_steps']}/{steady['steps']} in steady "
        f"decode ({share:.2%}); {elastic['driver_steps_total']}/{elastic['steps_total']} over the whole run; "
        f"{elastic['background_maps']} background pre-maps, {elastic['releases']} releases behind; reserve "
        f"hit rate {elastic['reserve_hit_rate']}",
        f"driver calls (elastic worker): {elastic['driver_calls']}",
    ]


def _engine_thread_lines(native: dict[str, Any], elastic: dict[str, Any]) -> list[str]:
    """The engine thread in the bursts: wall, CPU and garbage collection, then its time per burst by phase."""
    return [
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
    ]


def _set_up_lines(args: argparse.Namespace, native: dict[str, Any], elastic: dict[str, Any]) -> list[str]:
    """Which slot ran which backend on which CPUs, and each engine's start-up time."""
    return [
        f"slots: elastic in {'B, native in A' if args.swap else 'A, native in B'} (A starts first); CPUs: "
        + (
            ", ".join(f"{k} {v}" for k, v in args.cpu_split.items())
            if args.cpu_split
            else f"not pinned ({os.cpu_count()})"
        ),
        f"start-up: native {native['startup_s']} s, elastic {elastic['startup_s']} s, "
        f"delta {elastic['startup_s'] - native['startup_s']:+.2f} s",
    ]


def write_json(out: str, native: dict[str, Any], elastic: dict[str, Any], checks: dict[str, bool]) -> None:
    """``gpu_vllm.json`` in ``out``: both engines' reports and the checks."""
    (Path(out) / "gpu_vllm.json").write_text(
        json.dumps({"native": native, "elastic": elastic, "checks": checks})
    )
