"""A vLLM and an SGLang engine on one device (the host backend) share one budget.

Both plugins name the device with :func:`elastic_kv.device.device_key` (``cpu`` here, a GPU's UUID on a
GPU), so ``kvctl budget cpu ...`` bounds them together. The two engines run the same bursts twice: once
without a budget (what they take together), then under a budget well below that, sampled under the device
lock while they run. The sum of their charges never passes the budget, both engines finish with greedy
tokens equal to their native runs, and the budget really bound (the unbudgeted peak was above it).

Engines: a native SGLang engine first (its reference tokens; then closed), then the elastic SGLang engine
(its own process) and an elastic vLLM engine (in this process), two at a time at most.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic_kv.device import HOST_DEVICE, device_total_bytes
from elastic_kv.registry import DeviceBudget, Registry
from vllm_engines import TEST_ENV, elastic_llm, generate, sampling

from tests.support.models import tiny_model
from tests.support.sglang_engine import EngineProcess, plugin_installed, settled_snapshot, start_engine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.sglang,
    pytest.mark.skipif(not plugin_installed(), reason="sglang-elastic-kv is not installed"),
]

SLOT = 64 << 10
SGL_POOL = "one-device-sglang"
VLLM_POOL = "one-device-vllm"
# SGLang's burst: 8 requests of 48 prompt + 96 new tokens (about 72 pages of 64 KiB for the tiny model).
BURST = [[(7 * i + j) % 1000 + 4 for j in range(48)] for i in range(8)]
BURST_NEW = 96
SGL_KWARGS = {"page_size": 16, "max_total_tokens": 16384}


@pytest.fixture(scope="module")
def sglang_reference() -> list[list[int]]:
    with start_engine("one-device-native", tiny_model(), backend="native", **SGL_KWARGS) as eng:
        return eng.generate(BURST, max_new_tokens=BURST_NEW)


@pytest.fixture(scope="module")
def engines(registry_dir: Path, sglang_reference: list[list[int]]) -> Iterator[tuple[EngineProcess, Any]]:
    env = {**TEST_ENV, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir), "ELASTIC_KV_PUBLISH_INTERVAL_S": "0"}
    sgl = start_engine(
        SGL_POOL, tiny_model(), backend="elastic", env={**env, "ELASTIC_KV_POOL_NAME": SGL_POOL}, **SGL_KWARGS
    )
    try:
        with elastic_llm(env, VLLM_POOL) as llm:
            yield sgl, llm
    finally:
        sgl.close()


def _burst(
    sgl: EngineProcess, llm: Any, budget: DeviceBudget
) -> tuple[list[list[int]], list[list[int]], int]:
    """Both engines' bursts at once; their outputs and the peak of the device's summed charges."""
    out: dict[str, Any] = {}
    sglang = threading.Thread(target=lambda: out.update(sglang=sgl.generate(BURST, max_new_tokens=BURST_NEW)))

    def total() -> int:
        with budget.locked():  # one instant: the charges of both engines as a charge sees them
            return sum(budget.charges())

    with sampling(total, period=0.005) as samples:
        sglang.start()
        vllm_out = generate(llm)
        sglang.join(timeout=600)
    assert "sglang" in out, f"SGLang's burst did not finish\n{sgl.log_tail()}"
    return out["sglang"], vllm_out, max(samples)


def test_both_engines_name_one_device_and_its_size(
    engines: tuple[EngineProcess, Any], registry_dir: Path
) -> None:
    (device,) = Registry(registry_dir).devices()
    assert device.device == HOST_DEVICE
    assert set(device.pools) == {SGL_POOL, VLLM_POOL}
    assert device.total_bytes == device_total_bytes("cpu")  # recorded by both plugins
    assert {p.device for p in Registry(registry_dir).pools()} == {HOST_DEVICE}


def test_one_budget_bounds_both_engines_together(
    engines: tuple[EngineProcess, Any],
    registry_dir: Path,
    reference: dict[str, list[list[int]]],
    sglang_reference: list[list[int]],
) -> None:
    sgl, llm = engines
    budget = DeviceBudget.open(registry_dir, HOST_DEVICE, create=False)
    assert budget is not None
    try:
        sgl_out, vllm_out, free_peak = _burst(sgl, llm, budget)
        assert sgl_out == sglang_reference and vllm_out == reference["on"]
        settled_snapshot(registry_dir, SGL_POOL, lambda s: s.used_blocks == 0)
        idle = sum(budget.charges())
        # Well below what the two took together, but room for both to make progress.
        limit = idle + (free_peak - idle) // 2
        Registry(registry_dir).set_budget(HOST_DEVICE, limit)
        sgl_out, vllm_out, peak = _burst(sgl, llm, budget)
        assert free_peak > limit >= peak, (free_peak, limit, peak)
        assert sgl_out == sglang_reference and vllm_out == reference["on"]
    finally:
        Registry(registry_dir).set_budget(HOST_DEVICE, 0)
        budget.close()
