"""Fixtures of the SGLang plugin tests.

Engine tests (marker ``sglang``) share one engine per module: each module builds its engines with
:func:`start_engine` in a module-scoped fixture. An engine runs in its own driver process with the SGLang
CPU environment (see :mod:`tests.support.sglang_engine`); this pytest process never imports sglang with
that environment, so in-process unit tests see a plain SGLang import.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.support.models import REPO_ROOT, tiny_model
from tests.support.sglang_engine import CPU_ENGINE_KWARGS, EngineProcess

LOG_DIR = REPO_ROOT / ".cache" / "logs" / "sglang"


def plugin_installed() -> bool:
    """True when the plugin's entry point is installed (SGLang loads plugins by entry point only)."""
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    return any(ep.value.startswith("sglang_elastic_kv.") for ep in eps)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The tiny offline Llama (random weights, tokenizer) of tests/support/models.py."""
    return tiny_model()


def start_engine(
    name: str,
    model_path: Path,
    *,
    backend: str,
    env: Mapping[str, str] | None = None,
    **engine_kwargs: Any,
) -> EngineProcess:
    """Start an SGLang CPU engine named ``name`` (its log: ``.cache/logs/sglang/<name>.log``).

    ``backend`` is ``"native"`` or ``"elastic"`` (exported as ``ELASTIC_KV_SGLANG_BACKEND`` to the engine
    only); ``env`` adds engine-only variables; ``engine_kwargs`` override :data:`CPU_ENGINE_KWARGS`.
    """
    if not plugin_installed():
        pytest.skip("sglang-elastic-kv is not installed (pip install -e packages/sglang-elastic-kv)")
    kwargs = {**CPU_ENGINE_KWARGS, "max_total_tokens": 4096, **engine_kwargs}
    full_env = {"ELASTIC_KV_SGLANG_BACKEND": backend, **(env or {})}
    return EngineProcess(model_path, kwargs, env=full_env, log_path=LOG_DIR / f"{name}.log")
