"""Requests that arrive while the engine is idle are mapped ahead: the first step finds their pages backed.

A fresh interpreter runs the elastic engine core and worker in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so the scheduler's pool can be read at the moment the first step begins: ``LLM.generate`` adds the whole
batch, and each ``add_request`` asks the ledger to map its prompt's pages in the background
(``SchedulerPool.request_added`` -> ``Ledger.expect``). Then greedy tokens must still equal pure
vLLM's.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_engines import TEST_ENV, run_script

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    # A reserve cap above the batch's 30 prompt blocks (one 128-token block per 64 KiB page here), so that
    # what arrives can all be mapped ahead.
    env = {**TEST_ENV, "ELASTIC_KV_RESERVE_MAX": "64", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return run_script("arrivals", env)


def test_the_batch_is_mapped_ahead_of_the_first_step(run: dict[str, Any]) -> None:
    first = run["first_step"]
    assert first["waiting"] == 12  # the whole batch had arrived
    assert first["ahead"] >= 30 > run["idle_pages"], first
    assert first["used"] > 0 and first["maps"] == 0, "the first step mapped pages itself"


def test_decode_steps_and_only_they_maintain_the_reserve_as_light(run: dict[str, Any]) -> None:
    steps = run["steps"]
    assert all(decode == light for decode, light in steps), steps
    kinds = {decode for decode, _ in steps}
    assert kinds == {True, False}, steps  # prefill (chunked: 12 prompts of up to 1000 tokens) and decode


def test_same_tokens_as_pure_vllm(run: dict[str, Any], reference: dict[str, list[list[int]]]) -> None:
    assert run["tokens"] == reference["on"]
