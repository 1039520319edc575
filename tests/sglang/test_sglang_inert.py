"""Installed but not enabled, the plugin registers no memory hook (the engine-level proof -- the same
tokens as with the plugin skipped -- is in test_engine_elastic.py); an enabled plugin that cannot serve
refuses start-up instead of running native."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang


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
        assert seams.release_kv_cache in registered  # the prefix cache yields to the pool's limit
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)


def test_bad_setting_refuses_start_up_instead_of_running_native(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_kv.errors import ConfigError
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
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
