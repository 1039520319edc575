"""A real SGLang CPU engine with ``--kv-cache-backend=elastic`` (via the environment, as Engine users do):
greedy outputs equal the native engine's token for token (page_size 1 and 16, radix cache on, and under a
physical limit small enough to force retraction), and the pool's memory follows the load.

Engines (one at a time, ~2 GB each): native at page_size 1 and 16 give the reference tokens and are closed;
then one elastic engine per page size serves every test of its page size.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from elastic_kv.registry import Registry

from tests.support import sglang_engine as se
from tests.support.sglang_engine import EngineKind, EngineProcess

pytestmark = pytest.mark.sglang

MAX_TOTAL_TOKENS = 65536  # 64 MiB of KV for the tiny model: large enough to see in RSS
SMALL = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 60))]
BOUND = 256  # ELASTIC_KV_SGLANG_MAX_CACHED_TOKENS of the page_size 16 engine
ENGINES = EngineKind(kwargs={"max_total_tokens": MAX_TOTAL_TOKENS})


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> dict[Any, dict[str, list[list[int]]]]:
    """Native outputs at page_size 1 and 16 (the plugin installed, not enabled), and at page_size 1 with
    SGLang's plugin loader told to skip the plugin (``SGLANG_PLUGINS`` is its allow-list of names)."""
    out: dict[Any, dict[str, list[list[int]]]] = {}
    with ENGINES.start(
        "native-skipped", tiny_model_path, "native", {"SGLANG_PLUGINS": "none"}, page_size=1
    ) as eng:
        out["skipped"] = {"small": eng.generate(SMALL, max_new_tokens=24)}
    for ps in (1, 16):
        with ENGINES.start(f"native-ps{ps}", tiny_model_path, "native", {}, page_size=ps) as eng:
            out[ps] = {
                "small": eng.generate(SMALL, max_new_tokens=24),
                "heavy": eng.generate(se.HEAVY, max_new_tokens=se.HEAVY_NEW),
            }
            if ps == 1:
                out[ps]["mixed"] = eng.generate(se.MIXED, max_new_tokens=se.MIXED_NEW)
            eng.call("flush_cache")
            out[ps]["rss"] = [_scheduler_rss(eng)]
    return out


@pytest.fixture(scope="module")
def elastic_ps1(
    tiny_model_path: Path, registry_dir: Path, reference: dict[int, Any]
) -> Iterator[EngineProcess]:
    with ENGINES.elastic("elastic-ps1", tiny_model_path, registry_dir, page_size=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def elastic_ps16(
    tiny_model_path: Path, registry_dir: Path, reference: dict[int, Any], elastic_ps1: EngineProcess
) -> Iterator[EngineProcess]:
    # Depends on elastic_ps1 only to order the module's engines; it closes after this one.
    bound = {"ELASTIC_KV_SGLANG_MAX_CACHED_TOKENS": str(BOUND)}
    with ENGINES.elastic("elastic-ps16", tiny_model_path, registry_dir, bound, page_size=16) as eng:
        yield eng


def _scheduler_rss(eng: EngineProcess) -> int:
    procs = [psutil.Process(pid) for pid in eng.call("__children__")]
    return max(p.memory_info().rss for p in procs if p.is_running())


def test_installed_but_not_enabled_changes_nothing(reference: dict[Any, Any]) -> None:
    assert reference[1]["small"] == reference["skipped"]["small"]


# -- page_size 1 ----------------------------------------------------------------------------------------


def test_ps1_pool_is_elastic_and_starts_small(elastic_ps1: EngineProcess, registry_dir: Path) -> None:
    info = Registry(registry_dir).pool("elastic-ps1")
    assert info.engine == "sglang"
    snap = se.settled_snapshot(registry_dir, "elastic-ps1")
    assert snap.used_blocks == 0
    # Only the null page and the reserve are backed: far below the 64 MiB a native pool holds.
    assert snap.mapped_bytes <= (1 + snap.reserve_pages + snap.inflight_pages) * snap.page_bytes
    assert snap.mapped_bytes < 4 << 20


def test_ps1_outputs_equal_native(elastic_ps1: EngineProcess, reference: dict[int, Any]) -> None:
    assert elastic_ps1.generate(SMALL, max_new_tokens=24) == reference[1]["small"]
    # Again: now with prefix-cache hits on the same prompts (radix cache on).
    assert elastic_ps1.generate(SMALL, max_new_tokens=24) == reference[1]["small"]


def test_ps1_memory_follows_load(
    elastic_ps1: EngineProcess, registry_dir: Path, reference: dict[int, Any]
) -> None:
    name = "elastic-ps1"
    elastic_ps1.call("flush_cache")
    idle = se.settled_snapshot(registry_dir, name, lambda s: s.used_blocks == 0)
    out, peaks = se.generate_watching_peaks(elastic_ps1, registry_dir, (name,), se.HEAVY, se.HEAVY_NEW)
    peak = max(peaks[name], idle.mapped_bytes)
    assert out == reference[1]["heavy"]
    # 8 x 144 tokens x 2 layers x (K + V) x 256 B = 1.1 MiB of live KV at the peak.
    assert peak >= idle.mapped_bytes + (1 << 20), (idle, peak)
    # The prefix cache keeps the batch (no bound here); flushing it returns the memory.
    elastic_ps1.call("flush_cache")
    after = se.settled_snapshot(registry_dir, name, lambda s: s.used_blocks == 0)
    assert after.used_blocks == 0
    assert after.mapped_bytes <= idle.mapped_bytes


def test_ps1_flush_and_release_return_memory(elastic_ps1: EngineProcess, registry_dir: Path) -> None:
    name = "elastic-ps1"
    elastic_ps1.generate(SMALL, max_new_tokens=24)
    elastic_ps1.call("flush_cache")
    snap = se.settled_snapshot(registry_dir, name, lambda s: s.used_blocks == 0 and s.reserve_pages == 0)
    assert snap.used_blocks == 0
    elastic_ps1.generate(SMALL, max_new_tokens=24)
    elastic_ps1.call("release_memory_occupation", tags=["kv_cache"])
    snap = se.settled_snapshot(registry_dir, name, lambda s: s.used_blocks == 0 and s.reserve_pages == 0)
    assert snap.used_blocks == 0 and snap.reserve_pages == 0
    assert snap.mapped_bytes <= snap.page_bytes  # the null page only
    elastic_ps1.call("resume_memory_occupation", tags=["kv_cache"])
    assert len(elastic_ps1.generate(SMALL, max_new_tokens=8)[0]) == 8


# -- page_size 16 ---------------------------------------------------------------------------------------


def test_ps16_outputs_equal_native(elastic_ps16: EngineProcess, reference: dict[int, Any]) -> None:
    assert elastic_ps16.generate(SMALL, max_new_tokens=24) == reference[16]["small"]
    assert elastic_ps16.generate(SMALL, max_new_tokens=24) == reference[16]["small"]


def test_ps16_radix_bound(elastic_ps16: EngineProcess, registry_dir: Path, reference: dict[int, Any]) -> None:
    """After each request, the prefix cache keeps at most BOUND tokens: the rest is evicted through
    SGLang's own cache (UnifiedRadixCache, the engine default) and its pages return to the ledger."""
    assert elastic_ps16.generate(se.HEAVY, max_new_tokens=se.HEAVY_NEW) == reference[16]["heavy"]
    snap = se.settled_snapshot(registry_dir, "elastic-ps16", lambda s: s.used_blocks * 16 <= BOUND)
    assert snap.used_blocks * 16 <= BOUND, snap


def test_ps16_idle_rss_below_native(elastic_ps16: EngineProcess, reference: dict[Any, Any]) -> None:
    """Process RSS: after the same work and a flush, the elastic scheduler does not hold the 64 MiB of KV
    that the native one (same model, same settings) keeps touched."""
    elastic_ps16.generate(SMALL, max_new_tokens=24)
    elastic_ps16.call("flush_cache")
    time.sleep(0.5)
    rss = _scheduler_rss(elastic_ps16)
    native = reference[16]["rss"][0]
    kv_bytes = MAX_TOTAL_TOKENS * 2 * 2 * 256  # tokens x layers x (K, V) x row bytes
    print(f"idle scheduler RSS: native {native / 2**20:.0f} MiB, elastic {rss / 2**20:.0f} MiB")
    assert rss < native - kv_bytes // 2


def test_ps1_lowered_limit_with_mixed_lengths(
    elastic_ps1: EngineProcess, registry_dir: Path, reference: dict[int, Any]
) -> None:
    """A limit lowered below a running batch of mixed lengths at page_size 1 (SGLang's slots in 64-slot
    chunks, several chunks a page): the drain releases the pages of the requests SGLang retracts first,
    free slots on them are withheld, and the tokens stay the native ones."""
    mixed = se.generate_under_lowered_limit(elastic_ps1, registry_dir, "elastic-ps1", se.MIXED, se.MIXED_NEW)
    assert mixed == reference[1]["mixed"]
    assert elastic_ps1.generate(SMALL, max_new_tokens=24) == reference[1]["small"]


def test_ps16_lowered_limit_retracts_not_crashes(
    elastic_ps16: EngineProcess, registry_dir: Path, reference: dict[int, Any]
) -> None:
    """kvctl lowers the pool's limit below what a running batch uses: SGLang retracts requests (and later
    re-admits them within the limit) instead of failing an allocation; the tokens stay the native ones."""
    heavy = se.generate_under_lowered_limit(
        elastic_ps16, registry_dir, "elastic-ps16", se.HEAVY, se.HEAVY_NEW
    )
    assert heavy == reference[16]["heavy"]
    assert elastic_ps16.generate(SMALL, max_new_tokens=24) == reference[16]["small"]


@pytest.mark.parametrize("name", ["elastic-ps1", "elastic-ps16"])
def test_idle_leak_check_ran_and_passed(
    name: str, elastic_ps1: EngineProcess, elastic_ps16: EngineProcess
) -> None:
    """SGLang's idle check (available + evictable + ... == total, and the allocator's own accounting via
    verify_byte_accounting) runs on every idle scheduler pass and raises on a leak; it stayed on and quiet."""
    se.check_quiet_and_alive({"elastic-ps1": elastic_ps1, "elastic-ps16": elastic_ps16}[name])
