"""A Mamba / linear-attention hybrid (a tiny Qwen3-Next: GDN layers beside full attention) on a real
SGLang CPU engine with ``--kv-cache-backend=elastic``: greedy outputs equal the native engine's token for
token (which equal transformers'); the per-request state pool (conv + SSM state, the ``-mamba`` pool) maps
pages as requests take state slots and unmaps them as requests finish and the Mamba radix cache lets go; a
lowered KV limit retracts requests (freeing their state slots); SGLang's idle leak check stays quiet.

SGLang runs the model's GDN layers on the CPU with the plain-torch kernels of the ``sgl_kernel`` stand-in
and :mod:`tests.support.sglang_cpu_gdn` (native and elastic engines alike). Its Mamba radix cache runs with
the ``no_buffer`` strategy (the CPU platform has no state-snapshot support; it needs the overlap schedule
off). Engines (one at a time, ~2 GB each): the native one gives the reference tokens and is closed, then
one elastic engine serves every test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic_kv.registry import Registry

from tests.support import sglang_engine as se
from tests.support.models import transformers_greedy
from tests.support.sglang_engine import EngineKind, EngineProcess
from tests.support.sglang_models import GDN_ENGINE_ENV, tiny_gdn_model

pytestmark = pytest.mark.sglang

NAME = "gdn-elastic"
MAMBA_SLOTS = 64  # --max-mamba-cache-size: 16 pages of 4 state slots each at the engine tests' SLOT
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 38)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(100, 150))]
NEW = 12
# More requests at once than the state slots a budget at the device's charge leaves (the dummy slot's page,
# always backed, has 3 more); short enough that all their KV fits the attention pool's first chunk (63
# token slots beside the null slot, always backed), so state slots are what they wait for.
CROWD = [[(13 * i + 7) % 900 + 10, (5 * i + 3) % 900 + 10] for i in range(10)]
CROWD_NEW = 2
# GDN engines start slower than the tiny Llama's (more model code to import and build).
ENGINES = EngineKind(
    GDN_ENGINE_ENV,
    {
        "max_total_tokens": 4096,
        "max_mamba_cache_size": MAMBA_SLOTS,
        "mamba_radix_cache_strategy": "no_buffer",
        "disable_overlap_schedule": True,
    },
    start_timeout_s=600.0,
)


@pytest.fixture(scope="module")
def gdn_model(sglang_plugin: None) -> Path:
    return tiny_gdn_model()


@pytest.fixture(scope="module")
def reference(gdn_model: Path) -> dict[str, list[list[int]]]:
    runs = {"prompts": (PROMPTS, NEW), "heavy": (se.HEAVY, se.HEAVY_NEW), "crowd": (CROWD, CROWD_NEW)}
    return ENGINES.reference("gdn-native", gdn_model, runs)


@pytest.fixture(scope="module")
def elastic(gdn_model: Path, registry_dir: Path, reference: dict[str, Any]) -> Iterator[EngineProcess]:
    # No mapped reserve: what is mapped is what the slots hold (exact idle checks).
    no_reserve = {"ELASTIC_KV_RESERVE_MIN": "0", "ELASTIC_KV_RESERVE_MAX": "0", "ELASTIC_KV_PREMAP": "0"}
    with ENGINES.elastic(NAME, gdn_model, registry_dir, no_reserve) as eng:
        yield eng


def _flush(eng: EngineProcess) -> None:
    """``flush_cache``, retried: SGLang flushes (and releases memory) only when the scheduler is idle, and a
    batch whose outputs were just returned can stay in its running batch for one more scheduler pass."""
    deadline = time.monotonic() + 60
    while not eng.call("flush_cache").success:
        assert time.monotonic() < deadline, "the scheduler did not become idle"
        time.sleep(0.2)


def test_native_engine_matches_transformers(gdn_model: Path, reference: dict[str, Any]) -> None:
    """The native engine with the stand-in kernels computes what transformers computes (greedy, same
    tokens): the references below are the model's real outputs."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(gdn_model, dtype=torch.float32).eval()
    assert transformers_greedy(model, PROMPTS, NEW) == reference["prompts"]


def test_outputs_equal_native(elastic: EngineProcess, reference: dict[str, Any]) -> None:
    assert elastic.generate(PROMPTS, max_new_tokens=NEW) == reference["prompts"]


def test_state_pool_is_elastic_and_follows_requests(elastic: EngineProcess, registry_dir: Path) -> None:
    """Idle, the state pool holds the dummy slot's page only; a batch maps pages for its slots; when the
    requests finish and the radix cache lets their states go (flush), every slot's page is unmapped."""
    mamba = f"{NAME}-mamba"
    pools = {info.name for info in Registry(registry_dir).pools()}
    assert {NAME, mamba} <= pools  # the attention KV pool and the state pool, each elastic
    _flush(elastic)
    idle = se.settled_snapshot(registry_dir, mamba, lambda s: s.used_blocks == 0)
    assert idle.used_blocks == 0 and idle.mapped_pages == 1
    assert idle.total_blocks == MAMBA_SLOTS + 1
    batch = [[(11 * i + j) % 900 + 10 for j in range(16 + i)] for i in range(12)]
    _, peak = se.generate_watching_peaks(elastic, registry_dir, (mamba,), batch, max_new_tokens=8)
    # 12 requests hold 12 state slots at once; the dummy slot's page holds at most 3 of them.
    assert peak[mamba] >= idle.mapped_bytes + (12 - 3) * idle.block_size_bytes
    _flush(elastic)
    after = se.settled_snapshot(registry_dir, mamba, lambda s: s.used_blocks == 0 and s.mapped_pages == 1)
    assert after.used_blocks == 0 and after.mapped_bytes == idle.mapped_bytes


def test_lowered_limit_retracts_not_crashes(
    elastic: EngineProcess, registry_dir: Path, reference: dict[str, Any]
) -> None:
    """A KV limit below the batch's need makes SGLang retract requests (their state slots go back to the
    state pool) instead of failing an allocation; outputs stay exact."""
    out = se.generate_under_lowered_limit(elastic, registry_dir, NAME, se.HEAVY, se.HEAVY_NEW)
    assert out == reference["heavy"]
    _flush(elastic)
    state = se.settled_snapshot(registry_dir, f"{NAME}-mamba", lambda s: s.used_blocks == 0)
    assert state.used_blocks == 0


def test_a_budget_below_the_states_need_delays_requests_not_crashes(
    elastic: EngineProcess, registry_dir: Path, reference: dict[str, Any]
) -> None:
    """The device's budget is set to what it holds idle, which leaves 3 state slots, while 10 short
    requests arrive at once. SGLang 0.5.23 admits requests by its logical slot count here, and a state slot
    it cannot get is fatal (an assertion in ``HybridReqToTokenPool.alloc``, or where the radix cache
    checkpoints a prefilled request's state into a slot of its own); the plugin's admission counts the
    slots that can be backed, so the others wait their turn and every request ends with the native tokens."""
    mamba = f"{NAME}-mamba"
    _flush(elastic)
    idle = se.settled_snapshot(registry_dir, mamba, lambda s: s.used_blocks == 0 and s.mapped_pages == 1)
    registry = Registry(registry_dir)
    device = registry.pool(mamba).device
    budget = registry.device(device).charged_bytes
    registry.set_budget(device, budget)
    try:
        out, peak = se.generate_watching_peaks(
            elastic, registry_dir, (mamba,), CROWD, max_new_tokens=CROWD_NEW
        )
        assert out == reference["crowd"]
        assert peak[mamba] <= idle.mapped_bytes  # the dummy slot's page only: no slot beyond the budget
        assert registry.device(device).charged_bytes <= budget
    finally:
        registry.set_budget(device, 0)
    assert elastic.call("get_server_info") is not None  # the scheduler is alive
    _flush(elastic)


def test_sleep_returns_both_pools_and_wake_serves_the_same(
    elastic: EngineProcess, registry_dir: Path, reference: dict[str, Any]
) -> None:
    """``release_memory_occupation`` (the controller's sleep) leaves only the null page of the attention KV
    pool and the dummy slot's page of the state pool mapped; after ``resume`` the outputs are the same."""
    assert elastic.generate(PROMPTS, max_new_tokens=NEW) == reference["prompts"]
    _flush(elastic)  # SGLang releases memory only when idle (its release flushes the cache too)
    elastic.call("release_memory_occupation", tags=["kv_cache"])
    for name in (NAME, f"{NAME}-mamba"):
        snap = se.settled_snapshot(registry_dir, name, lambda s: s.used_blocks == 0 and s.mapped_pages == 1)
        assert snap.used_blocks == 0 and snap.mapped_pages == 1, snap
    elastic.call("resume_memory_occupation", tags=["kv_cache"])
    assert elastic.generate(PROMPTS, max_new_tokens=NEW) == reference["prompts"]


def test_idle_leak_check_ran_and_passed(elastic: EngineProcess) -> None:
    """SGLang's idle checks (KV and Mamba: available + evictable + protected == total, and the allocators'
    own accounting via verify_byte_accounting, which covers the state ledger) stayed on and quiet."""
    se.check_quiet_and_alive(elastic)
