"""Installed but not enabled, the plugin changes nothing: the same tokens as with SGLang's plugin loader
told to skip it, and no memory hook registered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sglang.conftest import start_engine

pytestmark = pytest.mark.sglang

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 60))]


@pytest.fixture(scope="module")
def outputs_without_plugin(tiny_model_path: Path) -> list[list[int]]:
    # SGLANG_PLUGINS is SGLang's allow-list of plugin names: a name nobody uses loads no plugin.
    with start_engine(
        "inert-skipped", tiny_model_path, backend="native", env={"SGLANG_PLUGINS": "none"}
    ) as eng:
        return eng.generate(PROMPTS, max_new_tokens=24)


@pytest.fixture(scope="module")
def engine_installed(tiny_model_path: Path) -> Iterator[object]:
    with start_engine("inert-installed", tiny_model_path, backend="native") as eng:
        yield eng


def test_outputs_equal_without_plugin(
    engine_installed: object, outputs_without_plugin: list[list[int]]
) -> None:
    assert engine_installed.generate(PROMPTS, max_new_tokens=24) == outputs_without_plugin  # type: ignore[attr-defined]


def test_register_adds_only_the_cli_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_elastic_kv import compat, plugin

    monkeypatch.delenv("ELASTIC_KV_SGLANG_BACKEND", raising=False)
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        HookRegistry._hooks.clear()
        plugin.register()
        assert sorted(HookRegistry._hooks) == sorted(compat.CLI_TARGETS)
        HookRegistry._hooks.clear()
        monkeypatch.setenv("ELASTIC_KV_SGLANG_BACKEND", "elastic")
        plugin.register()
        registered = set(HookRegistry._hooks)
        seams = compat.select(compat.installed_sglang_version())
        assert {seams.kv_pool_cls, seams.paged_allocator_cls, seams.allocator_builder} <= registered
        assert seams.release_kv_cache not in registered  # no bound configured
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)


def test_bad_setting_refuses_start_up_instead_of_running_native(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from elastic_kv.errors import ConfigError
    from sglang_elastic_kv import compat, plugin

    monkeypatch.setenv("ELASTIC_KV_SGLANG_BACKEND", "elastic")
    monkeypatch.setenv("ELASTIC_KV_SGLANG_TOKEN_CHUNK", "zero")
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        HookRegistry._hooks.clear()
        plugin.register()
        ((hook_type, hook, _),) = HookRegistry._hooks[compat.STARTUP_GUARD]
        assert hook_type is HookType.BEFORE
        with pytest.raises(ConfigError, match="ELASTIC_KV_SGLANG_TOKEN_CHUNK='zero'"):
            hook(object())
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)
