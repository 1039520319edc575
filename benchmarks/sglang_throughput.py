"""Decode throughput of a real SGLang CPU engine, elastic vs native, in one run (goal: ratio >= 0.99).

Both engines (tiny Llama, page_size 16, radix cache on) stay up side by side and the same batch is run
on each in alternation, ``ROUNDS`` times, so that the drift of a shared machine hits both alike; the
ratio of the median tokens/s is recorded in the benchmark's ``extra_info`` and printed.

    python -m pytest benchmarks/sglang_throughput.py -s --benchmark-disable-gc
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.models import REPO_ROOT, tiny_model
from tests.support.sglang_engine import CPU_ENGINE_KWARGS, EngineProcess

ROUNDS = 5
PROMPTS = [[(13 * i + j) % 1000 + 4 for j in range(32)] for i in range(16)]
NEW_TOKENS = 128
LOGS = REPO_ROOT / ".cache" / "logs" / "sglang"


def _engine(backend: str, registry: str) -> EngineProcess:
    env = {
        "ELASTIC_KV_SGLANG_BACKEND": backend,
        "ELASTIC_KV_PAGE_SIZE": str(64 << 10),
        "ELASTIC_KV_REGISTRY_DIR": registry,
    }
    kwargs = {**CPU_ENGINE_KWARGS, "page_size": 16, "max_total_tokens": 65536}
    return EngineProcess(tiny_model(), kwargs, env=env, log_path=LOGS / f"bench-{backend}.log")


def _tokens_per_s(eng: EngineProcess) -> float:
    start = time.perf_counter()
    outs = eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    elapsed = time.perf_counter() - start
    return sum(len(o) for o in outs) / elapsed


@pytest.mark.sglang
def test_decode_throughput_elastic_vs_native(benchmark: Any) -> None:
    registry = tempfile.mkdtemp(prefix="ekv-bench-")
    Path(registry).chmod(0o700)
    with _engine("native", registry) as native, _engine("elastic", registry) as elastic:
        ref = native.generate(PROMPTS, max_new_tokens=NEW_TOKENS)  # warm-up, and the reference tokens
        assert elastic.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == ref
        rates: dict[str, list[float]] = {"native": [], "elastic": []}

        def rounds() -> None:
            for i in range(ROUNDS):
                order = [("native", native), ("elastic", elastic)]
                for name, eng in order if i % 2 == 0 else order[::-1]:
                    eng.call("flush_cache")  # every round starts from an empty prefix cache
                    rates[name].append(_tokens_per_s(eng))

        benchmark.pedantic(rounds, rounds=1, iterations=1)
    native_med = statistics.median(rates["native"])
    elastic_med = statistics.median(rates["elastic"])
    ratio = elastic_med / native_med
    benchmark.extra_info.update(
        native_tok_s=native_med, elastic_tok_s=elastic_med, ratio=ratio, rounds=ROUNDS, raw=rates
    )
    print(f"\nnative {native_med:.1f} tok/s, elastic {elastic_med:.1f} tok/s, ratio {ratio:.3f}  raw={rates}")
