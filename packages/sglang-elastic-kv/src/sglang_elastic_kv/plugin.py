"""The ``sglang.srt.plugins`` entry point: what the plugin registers, and when.

SGLang calls :func:`register` in every process (the launcher, each scheduler, the detokenizer) and
applies the registered hooks right after. What is registered:

* always: the two command-line hooks of :mod:`sglang_elastic_kv.cli` (inert without the flag);
* only when ``ELASTIC_KV_SGLANG_BACKEND=elastic`` (set by the flag or by the user): the memory hooks of
  :mod:`sglang_elastic_kv.hooks` for the installed version's row of :mod:`sglang_elastic_kv.compat`.

SGLang logs and swallows an exception raised by a plugin, which would leave the engine silently
native. So an enabled plugin that cannot serve (unsupported version, bad setting) registers one
BEFORE hook on the KV pool constructor that raises the reason: the scheduler fails at start-up with it.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from elastic_kv.errors import ConfigError

from sglang_elastic_kv import cli, compat
from sglang_elastic_kv.config import PluginConfig

__all__ = ["register"]

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point (``sglang.srt.plugins``): register the hooks this process needs; see the module doc."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(compat.CLI_TARGETS[0], cli.add_cli_args_around, HookType.AROUND)
    HookRegistry.register(compat.CLI_TARGETS[1], cli.prepare_server_args_around, HookType.AROUND)
    try:
        config = PluginConfig.from_env(os.environ)
        if not config.enabled:
            return
        seams = compat.select(compat.installed_sglang_version())
    except ConfigError as exc:
        logger.error("elastic KV cache cannot start: %s", exc)
        HookRegistry.register(compat.STARTUP_GUARD, functools.partial(_refuse, exc), HookType.BEFORE)
        return

    from sglang_elastic_kv import hooks

    hooks.install(HookRegistry, HookType, seams, config)


def _refuse(error: ConfigError, *args: Any, **kwargs: Any) -> None:
    raise ConfigError(f"elastic KV cache cannot start: {error}")
