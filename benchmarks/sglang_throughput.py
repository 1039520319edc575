"""Decode throughput of a real SGLang CPU engine, elastic vs native, in one run (goal: ratio >= 0.99).

Both engines (tiny Llama, page_size 16, radix cache on) stay up side by side and the same batch is run
on each in alternation, ``ROUNDS`` times, so that the drift of a shared machine hits both alike. Two
rates per run: wall-clock tokens/s, and tokens per CPU-second of the engine's processes (driver,
scheduler -- which runs the model on the CPU -- and detokenizer), which stays meaningful when other
work shares the cores. The ratios of the medians are recorded in ``extra_info`` and printed.

    python -m pytest benchmarks/sglang_throughput.py -s --benchmark-disable-gc
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.models import REPO_ROOT, tiny_model
from tests.support.sglang_engine import CPU_ENGINE_KWARGS, EngineProcess

ROUNDS = 9
PROMPTS = [[(13 * i + j) % 1000 + 4 for j in range(32)] for i in range(16)]
NEW_TOKENS = 64
LOGS = REPO_ROOT / ".cache" / "logs" / "sglang"


def _engine(backend: str, registry: str) -> EngineProcess:
    env = {
        "ELASTIC_KV_SGLANG_BACKEND": backend,
        "ELASTIC_KV_PAGE_SIZE": str(64 << 10),
        "ELASTIC_KV_REGISTRY_DIR": registry,
    }
    # CPU_ENGINE_KWARGS and the engine environment give one compute thread each and no busy idle loop:
    # the engine waiting for its turn must not take the cores from the one being measured.
    kwargs = {**CPU_ENGINE_KWARGS, "page_size": 16, "max_total_tokens": 65536}
    return EngineProcess(tiny_model(), kwargs, env=env, log_path=LOGS / f"bench-{backend}.log")


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _rates(eng: EngineProcess, pids: list[int]) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of the engine's processes) for one batch."""
    cpu0, start = _cpu_seconds(pids), time.perf_counter()
    outs = eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    elapsed, cpu = time.perf_counter() - start, _cpu_seconds(pids) - cpu0
    tokens = sum(len(o) for o in outs)
    return tokens / elapsed, tokens / cpu


@pytest.mark.sglang
def test_decode_throughput_elastic_vs_native(benchmark: Any) -> None:
    registry = tempfile.mkdtemp(prefix="ekv-bench-")
    Path(registry).chmod(0o700)
    with _engine("native", registry) as native, _engine("elastic", registry) as elastic:
        ref = native.generate(PROMPTS, max_new_tokens=NEW_TOKENS)  # warm-up, and the reference tokens
        assert elastic.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == ref
        pids = {"native": [native.pid, *native.child_pids], "elastic": [elastic.pid, *elastic.child_pids]}
        wall: dict[str, list[float]] = {"native": [], "elastic": []}
        cpu: dict[str, list[float]] = {"native": [], "elastic": []}

        def rounds() -> None:
            for i in range(ROUNDS):
                order = [("native", native), ("elastic", elastic)]
                for name, eng in order if i % 2 == 0 else order[::-1]:
                    eng.call("flush_cache")  # every round starts from an empty prefix cache
                    w, c = _rates(eng, pids[name])
                    wall[name].append(w)
                    cpu[name].append(c)

        benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {k: {n: statistics.median(v[n]) for n in v} for k, v in (("wall", wall), ("cpu", cpu))}
    ratio_wall = med["wall"]["elastic"] / med["wall"]["native"]
    ratio_cpu = med["cpu"]["elastic"] / med["cpu"]["native"]
    benchmark.extra_info.update(medians=med, ratio_wall=ratio_wall, ratio_cpu=ratio_cpu, wall=wall, cpu=cpu)
    print(
        f"\nwall: native {med['wall']['native']:.1f} tok/s, elastic {med['wall']['elastic']:.1f} tok/s, "
        f"ratio {ratio_wall:.3f}\ncpu:  native {med['cpu']['native']:.1f} tok/cpu-s, elastic "
        f"{med['cpu']['elastic']:.1f} tok/cpu-s, ratio {ratio_cpu:.3f}\nraw wall={wall}\nraw cpu={cpu}"
    )
