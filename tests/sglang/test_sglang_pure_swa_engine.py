"""A real SGLang CPU engine serving an all-sliding-window (pure SWA) model with
``--kv-cache-backend=elastic``: greedy outputs equal the native engine's token for token (radix cache on,
prompts longer than the window so SGLang frees out-of-window slots and reuses them, and under a physical
limit small enough to force retraction); the pool's memory grows with a batch and returns; SGLang's idle
leak check stays on and passes.

The model is the tiny Laguna of :mod:`tests.support.sglang_models` with every layer sliding (window 96).
SGLang gives it ``SWAKVPool`` with an empty full-attention side and ``PureSWATokenToKVPoolAllocator``
(page_size 1 only). One native engine gives the reference tokens and is closed; one elastic engine serves
every test here. Both run with the test-only CPU attention correction of
:mod:`tests.support.sglang_cpu_fixes`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic_kv.registry import Registry

from tests.support import sglang_engine as se
from tests.support.models import transformers_greedy
from tests.support.sglang_engine import EngineKind, EngineProcess
from tests.support.sglang_models import SWA_ENGINE_ENV, TINY_PURE_SWA, tiny_swa_model

pytestmark = pytest.mark.sglang

MAX_TOTAL_TOKENS = 1536
NAME = "pure-swa-elastic"
POOL = f"{NAME}-swa"  # the one pool with memory; the full-attention side has no layers
# Prompts shorter and longer than the window; the longest frees out-of-window slots while it decodes.
PROMPTS = [[(5 * i + 3 * j) % 1000 + 4 for j in range(n)] for i, n in enumerate((40, 75, 110))]
NEW = 40


ENGINES = EngineKind(SWA_ENGINE_ENV, {"page_size": 1, "max_total_tokens": MAX_TOTAL_TOKENS})


@pytest.fixture(scope="module")
def model(sglang_plugin: None) -> Path:
    return tiny_swa_model(TINY_PURE_SWA)


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, list[list[int]]]:
    runs = {"prompts": (PROMPTS, NEW), "heavy": (se.HEAVY, se.HEAVY_NEW), "mixed": (se.MIXED, se.MIXED_NEW)}
    return ENGINES.reference("pure-swa-native", model, runs)


@pytest.fixture(scope="module")
def elastic(model: Path, registry_dir: Path, reference: dict[str, Any]) -> Iterator[EngineProcess]:
    with ENGINES.elastic(NAME, model, registry_dir) as eng:
        yield eng


def test_native_engine_matches_transformers(model: Path, reference: dict[str, Any]) -> None:
    """The corrected native engine computes what transformers computes for the all-sliding model."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert set(hf.config.layer_types) == {"sliding_attention"}
    assert transformers_greedy(hf, PROMPTS, NEW) == reference["prompts"]


def test_one_elastic_pool_serves_every_layer(elastic: EngineProcess, registry_dir: Path) -> None:
    pools = {info.name for info in Registry(registry_dir).pools()}
    assert POOL in pools and f"{NAME}-full" not in pools  # no layers, no memory, no record
    idle = se.settled_snapshot(registry_dir, POOL, lambda s: s.used_blocks == 0)
    assert idle.mapped_bytes <= (1 + idle.reserve_pages + idle.inflight_pages) * idle.page_bytes


def test_outputs_equal_native(elastic: EngineProcess, reference: dict[str, Any]) -> None:
    assert elastic.generate(PROMPTS, max_new_tokens=NEW) == reference["prompts"]
    # Again: now with prefix-cache hits on the same prompts (radix cache on).
    assert elastic.generate(PROMPTS, max_new_tokens=NEW) == reference["prompts"]


def test_memory_grows_and_returns(
    elastic: EngineProcess, registry_dir: Path, reference: dict[str, Any]
) -> None:
    elastic.call("flush_cache")
    idle = se.settled_snapshot(registry_dir, POOL, lambda s: s.used_blocks == 0)
    out, peaks = se.generate_watching_peaks(elastic, registry_dir, (POOL,), se.HEAVY, se.HEAVY_NEW)
    assert out == reference["heavy"]
    # 8 x 96 in-window tokens x 4 layers x (K + V) x 256 B = 1.5 MiB at the peak.
    assert max(peaks[POOL], idle.mapped_bytes) >= idle.mapped_bytes + 2 * idle.page_bytes, (idle, peaks)
    elastic.call("flush_cache")
    after = se.settled_snapshot(registry_dir, POOL, lambda s: s.used_blocks == 0)
    assert after.used_blocks == 0
    assert after.mapped_bytes <= max(idle.mapped_bytes, (1 + after.reserve_pages) * after.page_bytes)


def test_lowered_limit_retracts_not_crashes(
    elastic: EngineProcess, registry_dir: Path, reference: dict[str, Any]
) -> None:
    """kvctl lowers the pool's limit below what a running batch needs: SGLang retracts requests (and
    re-admits them within the limit) instead of failing an allocation; the tokens stay the native ones.
    Twice, the second time with requests of mixed lengths: every decode step while the pool drains
    passes SGLang's capacity check, then frees out-of-window slots in a free group whose housekeeping
    withholds free slots on draining pages, then allocates (what the check admitted must still be there:
    ``tests/sglang/test_sglang_drain_units.py::test_a_decode_check_holds_through_the_free_group_before_the_allocation``)."""
    heavy = se.generate_under_lowered_limit(elastic, registry_dir, POOL, se.HEAVY, se.HEAVY_NEW)
    assert heavy == reference["heavy"]
    mixed = se.generate_under_lowered_limit(elastic, registry_dir, POOL, se.MIXED, se.MIXED_NEW)
    assert mixed == reference["mixed"]
    assert elastic.generate(PROMPTS, max_new_tokens=NEW) == reference["prompts"]


def test_idle_leak_check_ran_and_passed(elastic: EngineProcess) -> None:
    se.check_quiet_and_alive(elastic)
