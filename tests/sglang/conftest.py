"""Fixtures of the SGLang plugin tests.

Engine tests (marker ``sglang``) share one engine per module: each module builds its engines with
:func:`tests.support.sglang_engine.start_engine` (or, where they share their settings, an
:class:`tests.support.sglang_engine.EngineKind`) in a module-scoped fixture. An engine runs in its own
driver process with the SGLang CPU environment (see :mod:`tests.support.sglang_engine`); this pytest
process never imports sglang with that environment, so in-process unit tests see a plain SGLang import.
Engine tests ask for ``sglang_plugin``: they are skipped when the plugin is not installed (SGLang finds
plugins by entry point only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import tiny_model
from tests.support.sglang_engine import plugin_installed

# The data plane's page size in the in-process unit tests (the host backend's granularity is 4 KiB).
UNIT_SLOT = 64 << 10


@pytest.fixture(scope="session")
def sglang_plugin() -> None:
    """Skips the engine test that asks for it when the plugin is not installed."""
    if not plugin_installed():
        pytest.skip("sglang-elastic-kv is not installed (pip install -e packages/sglang-elastic-kv)")


@pytest.fixture(scope="session")
def tiny_model_path(sglang_plugin: None) -> Path:
    """The tiny offline Llama (random weights, tokenizer) of tests/support/models.py."""
    return tiny_model()


@pytest.fixture(scope="module")
def registry_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private registry directory per engine module (mode 0700, as the registry requires)."""
    path = tmp_path_factory.mktemp("registry")
    path.chmod(0o700)
    return path


@pytest.fixture
def elastic_pool_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """The plugin's environment for pools built in this process by a test, on any backend: elastic, a
    private registry in the test's temporary directory, and no reserve kept (the data plane's own page
    size, as a GPU test needs)."""
    tmp_path.chmod(0o700)
    monkeypatch.setenv("ELASTIC_KV_SGLANG_BACKEND", "elastic")
    monkeypatch.setenv("ELASTIC_KV_REGISTRY_DIR", str(tmp_path))
    monkeypatch.setenv("ELASTIC_KV_RESERVE_MIN", "0")
    monkeypatch.setenv("ELASTIC_KV_RESERVE_MAX", "0")
    return monkeypatch


@pytest.fixture
def plugin_env(elastic_pool_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The plugin's environment for pools built in this process by a unit test: ``elastic_pool_env`` with
    ``UNIT_SLOT`` pages and no reserve refilled or mapped ahead either, so mapped bytes follow the blocks
    exactly. Modules add their own settings on top."""
    elastic_pool_env.setenv("ELASTIC_KV_PAGE_SIZE", str(UNIT_SLOT))
    elastic_pool_env.setenv("ELASTIC_KV_PREMAP", "0")
    return elastic_pool_env


@pytest.fixture
def named_env(plugin_env: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> pytest.MonkeyPatch:
    """``plugin_env`` with 64-slot chunks, its pools named after the test module's ``NAME``."""
    plugin_env.setenv("ELASTIC_KV_POOL_NAME", request.module.NAME)
    plugin_env.setenv("ELASTIC_KV_SGLANG_TOKEN_CHUNK", "64")
    return plugin_env
