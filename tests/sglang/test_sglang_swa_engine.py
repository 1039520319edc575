"""A real SGLang CPU engine serving a hybrid sliding-window (SWA) model with ``--kv-cache-backend=elastic``:
greedy outputs equal the native engine's token for token at page_size 1 and 16 (radix cache on, prompts
longer than the window so SGLang frees out-of-window SWA slots and reuses them, and under a physical
limit small enough to force retraction); both sub-pools' memory follows the load; SGLang's idle leak check
stays on and passes. The native engine itself is checked against transformers' own model.

The model is the tiny Laguna of :mod:`tests.support.sglang_models` (three sliding-window layers of window
32 per full-attention layer). Every engine here, native or elastic, runs with the test-only CPU attention
correction of :mod:`tests.support.sglang_cpu_fixes`. Engines run one at a time: the two native ones give
the reference tokens and are closed, then one elastic engine per page size serves its tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic_kv.registry import Registry
from elastic_kv.snapshot import PoolSnapshot

from tests.support import sglang_engine as se
from tests.support.models import transformers_greedy
from tests.support.sglang_engine import EngineKind, EngineProcess
from tests.support.sglang_models import SWA_ENGINE_ENV, tiny_swa_model

pytestmark = pytest.mark.sglang

# Small enough that the reference run wraps the SWA pool's free list (the SWA pool holds ~0.8x the full
# pool's tokens): from then on a token's SWA slot differs from its full-attention slot, which is what the
# CPU attention correction and the elastic allocator's slot table must get right.
MAX_TOTAL_TOKENS = 1536
WINDOW = 32  # the model's sliding window
# Prompts longer than the window; with NEW tokens each request frees out-of-window SWA slots as it goes.
PROMPTS = [[(5 * i + 3 * j) % 1000 + 4 for j in range(n)] for i, n in enumerate((40, 75, 110))]
NEW = 40


ENGINES = EngineKind(SWA_ENGINE_ENV, {"max_total_tokens": MAX_TOTAL_TOKENS})


@pytest.fixture(scope="module")
def swa_model(sglang_plugin: None) -> Path:
    return tiny_swa_model()


@pytest.fixture(scope="module")
def reference(swa_model: Path) -> dict[int, dict[str, list[list[int]]]]:
    """Native outputs at page_size 1 and 16."""
    runs = {"prompts": (PROMPTS, NEW), "heavy": (se.HEAVY, se.HEAVY_NEW)}
    return {ps: ENGINES.reference(f"swa-native-ps{ps}", swa_model, runs, page_size=ps) for ps in (1, 16)}


@pytest.fixture(scope="module")
def elastic_ps1(swa_model: Path, registry_dir: Path, reference: dict[int, Any]) -> Iterator[EngineProcess]:
    with ENGINES.elastic("swa-elastic-ps1", swa_model, registry_dir, page_size=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def elastic_ps16(
    swa_model: Path, registry_dir: Path, reference: dict[int, Any], elastic_ps1: EngineProcess
) -> Iterator[EngineProcess]:
    # Depends on elastic_ps1 only to order the module's engines; it closes after this one.
    with ENGINES.elastic("swa-elastic-ps16", swa_model, registry_dir, page_size=16) as eng:
        yield eng


def _idle(registry_dir: Path, name: str) -> PoolSnapshot:
    return se.settled_snapshot(registry_dir, name, lambda s: s.used_blocks == 0)


# -- the reference itself -----------------------------------------------------------------------------------


def test_native_engine_matches_transformers(swa_model: Path, reference: dict[int, Any]) -> None:
    """The corrected native engine computes the model transformers computes (greedy, same tokens): the
    CPU attention correction is a correction, and the references below are the model's real outputs."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(swa_model, dtype=torch.float32).eval()
    assert model.config.sliding_window == WINDOW
    assert transformers_greedy(model, PROMPTS, NEW) == reference[1]["prompts"]
    # The batch served after the first one: by then SWA slots and full slots differ.
    assert transformers_greedy(model, se.HEAVY, se.HEAVY_NEW, batch=True) == reference[1]["heavy"]
    # The page size changes where KV lives, not what is computed: page_size 16 gives the same tokens.
    assert reference[16] == reference[1]


# -- page_size 1 --------------------------------------------------------------------------------------------


def test_ps1_outputs_equal_native(elastic_ps1: EngineProcess, reference: dict[int, Any]) -> None:
    assert elastic_ps1.generate(PROMPTS, max_new_tokens=NEW) == reference[1]["prompts"]
    # Again: now with prefix-cache hits on the same prompts (radix cache on).
    assert elastic_ps1.generate(PROMPTS, max_new_tokens=NEW) == reference[1]["prompts"]


def test_ps1_both_pools_follow_load(
    elastic_ps1: EngineProcess, registry_dir: Path, reference: dict[int, Any]
) -> None:
    names = ("swa-elastic-ps1-full", "swa-elastic-ps1-swa")
    elastic_ps1.call("flush_cache")
    idle = {name: _idle(registry_dir, name) for name in names}
    for snap in idle.values():
        # Before a batch: the null page and the reserve, nothing in use.
        assert snap.used_blocks == 0
        assert snap.mapped_bytes <= (1 + snap.reserve_pages + snap.inflight_pages) * snap.page_bytes
    out, peaks = se.generate_watching_peaks(elastic_ps1, registry_dir, names, se.HEAVY, se.HEAVY_NEW)
    peak = {name: max(peaks[name], idle[name].mapped_bytes) for name in names}
    assert out == reference[1]["heavy"]
    for name in names:
        # During: 8 x 144 tokens of full-attention KV (4.5 pages); on the SWA side the 8 x 48-token
        # prefill before out-of-window slots are freed (1.5 pages).
        assert peak[name] >= idle[name].mapped_bytes + idle[name].page_bytes, (name, idle[name], peak[name])
    # After: the prefix cache keeps the batch (no bound); flushing it returns both pools' memory.
    elastic_ps1.call("flush_cache")
    for name in names:
        after = _idle(registry_dir, name)
        assert after.used_blocks == 0
        assert after.mapped_bytes <= max(
            idle[name].mapped_bytes, (1 + after.reserve_pages) * after.page_bytes
        )


# -- page_size 16 -------------------------------------------------------------------------------------------


def test_ps16_outputs_equal_native(elastic_ps16: EngineProcess, reference: dict[int, Any]) -> None:
    assert elastic_ps16.generate(PROMPTS, max_new_tokens=NEW) == reference[16]["prompts"]
    assert elastic_ps16.generate(PROMPTS, max_new_tokens=NEW) == reference[16]["prompts"]


def test_ps16_lowered_limit_retracts_not_crashes(
    elastic_ps16: EngineProcess, registry_dir: Path, reference: dict[int, Any]
) -> None:
    """kvctl lowers the full-attention pool's limit below what a running batch uses: SGLang retracts
    requests (and re-admits them within the limit) instead of failing an allocation; same tokens."""
    name = "swa-elastic-ps16-full"
    heavy = se.generate_under_lowered_limit(elastic_ps16, registry_dir, name, se.HEAVY, se.HEAVY_NEW)
    assert heavy == reference[16]["heavy"]
    assert elastic_ps16.generate(PROMPTS, max_new_tokens=NEW) == reference[16]["prompts"]


def test_ps16_sliding_window_pool_limit_is_followed(
    elastic_ps16: EngineProcess, registry_dir: Path, reference: dict[int, Any]
) -> None:
    """A limit on the sliding-window pool alone: SGLang's SWA admission budget and decode check see what
    that pool can back, so the batch runs within it (admission defers, decode retracts; nothing fails)
    and gives the same tokens."""
    name = "swa-elastic-ps16-swa"
    retracted_before = elastic_ps16.log_path.read_text().count("Retract requests")
    elastic_ps16.call("flush_cache")
    page_bytes = _idle(registry_dir, name).page_bytes
    limit = 2 * page_bytes  # the null page and one more: ~500 SWA tokens for 8 x 48-token prompts
    registry = Registry(registry_dir)
    registry.set_limit(name, limit)
    try:
        se.settled_snapshot(registry_dir, name, lambda s: s.limit_bytes == limit)
        out, peaks = se.generate_watching_peaks(elastic_ps16, registry_dir, (name,), se.HEAVY, se.HEAVY_NEW)
        peak = peaks[name]
        assert out == reference[16]["heavy"]
        assert 0 < peak <= limit
        log = elastic_ps16.log_path.read_text()
        assert log.count("Retract requests") > retracted_before  # the SWA side's decode check bound
        assert "Out of memory" not in log
    finally:
        registry.set_limit(name, 0)


@pytest.mark.parametrize("name", ["swa-elastic-ps1", "swa-elastic-ps16"])
def test_idle_leak_check_ran_and_passed(
    name: str, elastic_ps1: EngineProcess, elastic_ps16: EngineProcess, registry_dir: Path
) -> None:
    """SGLang's idle check (full and SWA: available + evictable == total, and the allocator's own
    accounting via verify_byte_accounting on both sub-pools) stayed on and quiet."""
    eng = {"swa-elastic-ps1": elastic_ps1, "swa-elastic-ps16": elastic_ps16}[name]
    pools = {info.name for info in Registry(registry_dir).pools()}
    assert {f"{name}-full", f"{name}-swa"} <= pools  # both sub-pools elastic, each in the registry
    se.check_quiet_and_alive(eng)
