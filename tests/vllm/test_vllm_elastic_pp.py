"""Pipeline parallelism: one elastic engine with PP=2 (two stages, each a worker process that owns half of
the layers; ``mp`` executor, ``VLLM_CPU_OMP_THREADS_BIND`` gives each stage one core).

Each stage is a rank of the pool: the coordinator's handshake and every map and two-phase unmap reach both
stages, each stage backs the pages in its own layers' spaces, and the host device is charged for both.
The greedy tokens equal pure vLLM's at PP=1 (a stage runs the same layers with the same kernels).

vllm-cpu needs its compiled mode for PP: in eager mode its CPU model runner skips the warm-up that
allocates a later stage's intermediate tensors, and the second stage fails on its first step (native
vLLM alike). With fewer than two CPUs the module is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_engines

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="PP=2 needs a core per stage"),
]

POOL = "test-pp"
PP = 2


@pytest.fixture(scope="module")
def llm(registry_dir: Path) -> Iterator[Any]:
    env = {
        **vllm_engines.TEST_ENV,
        "ELASTIC_KV_REGISTRY_DIR": str(registry_dir),
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    with vllm_engines.elastic_llm(
        env, POOL, pipeline_parallel_size=PP, distributed_executor_backend="mp", enforce_eager=False
    ) as engine:
        yield engine


def test_greedy_outputs_equal_native(llm: Any, reference: dict[str, list[list[int]]]) -> None:
    assert vllm_engines.generate(llm) == reference["on"]


def test_each_stage_backs_its_own_layers_on_the_same_pages(llm: Any, registry_dir: Path) -> None:
    infos = vllm_engines.check_one_process_per_rank(llm, PP)
    # The tiny model's two layers: one per stage, each stage's spaces cover only its own layer.
    assert [i["kv_cache_groups"] for i in infos] == ["1 x FullAttentionSpec (1 layer)"] * PP
    assert vllm_engines.wait_for(lambda: vllm_engines.ranks_back_the_same_pages(llm))


def test_the_device_is_charged_for_every_stage(llm: Any, registry_dir: Path) -> None:
    vllm_engines.generate(llm)
    vllm_engines.check_device_charged_for_every_rank(llm, registry_dir, POOL)


def test_an_idle_engine_returns_to_the_null_page_and_reserve_on_every_stage(
    llm: Any, registry_dir: Path
) -> None:
    # Prefix caching keeps the prompts' blocks cached: an idle trim (kvctl trim) returns them on both stages.
    import subprocess
    import sys

    env = {**os.environ, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv.cli.kvctl", "trim", POOL, "--wait", "60"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    idle = vllm_engines.idle_bytes(registry_dir, POOL, PP)
    assert vllm_engines.wait_for(lambda: vllm_engines.charged_bytes(registry_dir, POOL) <= idle)
