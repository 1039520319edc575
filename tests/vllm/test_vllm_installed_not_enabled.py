"""Installed but not enabled: the plugin changes nothing.

A fresh interpreter with the plugin installed (its entry point loads) and the backend left at ``native``
runs the engine core and the worker in-process, so everything that ran can be inspected: vLLM's own
scheduler, KV cache manager, block pool and worker classes, no engine symbol patched, the same greedy
tokens as pure vLLM (which ran with the plugin excluded through ``VLLM_PLUGINS``).
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_engines import run_script

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    return run_script(
        "installed-not-enabled", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ELASTIC_KV_BACKEND": ""}
    )


def test_plugin_was_loaded(run: dict[str, Any]) -> None:
    assert "elastic_kv" in run["plugins"]


def test_same_tokens_as_pure_vllm(run: dict[str, Any], reference: dict[str, list[list[int]]]) -> None:
    assert run["tokens"] == reference["on"]


def test_vllms_own_classes_ran(run: dict[str, Any]) -> None:
    assert run["classes"] == [
        "vllm.v1.core.sched.scheduler.Scheduler",
        "vllm.v1.core.kv_cache_manager.KVCacheManager",
        "vllm.v1.core.block_pool.BlockPool",
        "vllm.v1.worker.cpu_worker.CPUWorker",
    ]
    assert run["additional_config"] == {}


def test_only_the_front_end_entry_points_are_wrapped(run: dict[str, Any]) -> None:
    # vLLM has no API to add a flag or to redirect a config to other classes: these three wrappers are
    # how --kv-cache-backend exists; with the native backend they return exactly what vLLM returns
    # (test_vllm_activation.py::test_native_config_is_what_vllm_builds).
    assert sorted(run["patched"]) == [
        "vllm.engine.arg_utils.EngineArgs.add_cli_args: cli-flag",
        "vllm.engine.arg_utils.EngineArgs.create_engine_config: activation",
        "vllm.engine.arg_utils.EngineArgs.from_cli_args: cli-to-additional-config",
    ]
