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


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24"])
def test_unsupported_version_refuses_start_up_in_one_line(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """The installed version is read from the distribution; another version than the ones the tests ran
    makes the scheduler's first KV pool fail with one line naming the version and the supported one."""
    from elastic_kv.errors import ConfigError
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_elastic_kv import compat, plugin

    monkeypatch.setenv("ELASTIC_KV_SGLANG_BACKEND", "elastic")
    monkeypatch.setattr(compat, "installed_sglang_version", lambda: version)
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        HookRegistry._hooks.clear()
        plugin.register()
        assert set(HookRegistry._hooks) == {*compat.CLI_TARGETS, compat.STARTUP_GUARD}  # no memory hook
        ((_, hook, _),) = HookRegistry._hooks[compat.STARTUP_GUARD]
        with pytest.raises(ConfigError) as info:
            hook(object())
        text = str(info.value)
        assert (
            "\n" not in text and f"sglang {version}:" in text and "supported engine-verified 0.5.23" in text
        )
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)
