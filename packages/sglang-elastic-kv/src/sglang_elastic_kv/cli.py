"""``--kv-cache-backend={native,elastic}`` for ``python -m sglang.launch_server`` and ``sglang serve``.

SGLang has no API for a plugin's server argument: ``ServerArgs`` is a msgspec struct whose
``from_cli_args`` copies declared fields only. Both entry points call ``load_plugins()`` before they
parse ``argv`` through ``prepare_server_args``, so two AROUND hooks give the flag a real home:

* ``ServerArgs.add_cli_args`` gains the option, so ``--help`` lists it and argparse validates it;
  ``from_cli_args`` then drops it, leaving ``ServerArgs`` exactly as without the plugin.
* ``prepare_server_args`` reads the option before SGLang parses ``argv`` and exports the choice as
  ``ELASTIC_KV_SGLANG_BACKEND``; the schedulers, spawned later, inherit it and load the plugin enabled.
  With the elastic backend (the flag or the variable), an unsupported SGLang version or a bad
  ``ELASTIC_KV_*`` setting ends the command here, before any process is spawned, with one line on stderr
  that names it and shows a valid value, and exit status 2 (argparse's, for bad arguments).

These two hooks are installed even when the plugin is not enabled (the flag is how it gets enabled);
without the flag they change nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from elastic_kv.errors import ConfigError

from sglang_elastic_kv import compat
from sglang_elastic_kv.config import BACKEND_ENV, BACKENDS, PluginConfig

__all__ = ["EXIT_BAD_SETTING", "FLAG", "add_cli_args_around", "parse_backend", "prepare_server_args_around"]

logger = logging.getLogger(__name__)

FLAG = "--kv-cache-backend"
EXIT_BAD_SETTING = 2  # argparse's status for bad arguments: a bad setting is one
_HELP = (
    "KV cache memory backend (sglang-elastic-kv plugin). 'native': SGLang's preallocated KV cache. "
    "'elastic': the same buffers and kernels, backed by memory only while KV entries use it. "
    f"Same as setting {BACKEND_ENV}."
)


def parse_backend(argv: Sequence[str]) -> str | None:
    """The value of ``--kv-cache-backend`` in ``argv`` (either spelling), or None when absent.

    A value outside ``native``/``elastic`` makes argparse exit with its usual usage error.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(FLAG, choices=BACKENDS, default=None)
    known, _ = parser.parse_known_args(list(argv))
    value: str | None = known.kv_cache_backend
    return value


def add_cli_args_around(
    original: Callable[..., Any], parser: argparse.ArgumentParser, *a: Any, **k: Any
) -> Any:
    """AROUND ``ServerArgs.add_cli_args``: SGLang's arguments, then ``--kv-cache-backend``."""
    result = original(parser, *a, **k)
    if FLAG not in parser._option_string_actions:  # the same parser may be filled twice
        parser.add_argument(FLAG, choices=BACKENDS, default=None, help=_HELP)
    return result


def prepare_server_args_around(original: Callable[..., Any], argv: Sequence[str], *a: Any, **k: Any) -> Any:
    """AROUND ``prepare_server_args``: export the backend choice, check the version, then parse as usual."""
    backend = parse_backend(argv)
    if backend is not None:
        os.environ[BACKEND_ENV] = backend
    try:
        config = PluginConfig.from_env(os.environ)
        if config.enabled:
            config.pool_config()  # every ELASTIC_KV_* setting of the pool, checked before any spawn
            version = compat.installed_sglang_version()
            compat.select(version)  # the version and every symbol the plugin relies on
            logger.info("elastic KV cache enabled (%s) on sglang %s", FLAG, version)
    except ConfigError as exc:
        print(f"sglang-elastic-kv: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_SETTING) from None
    return original(argv, *a, **k)
