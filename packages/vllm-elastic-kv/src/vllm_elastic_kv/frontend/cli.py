"""``--kv-cache-backend={native,elastic}``: a thin flag over ``--additional-config.kv_cache_backend``.

vLLM offers plugins no way to add a command-line option. The least invasive route found in its source:

* ``AsyncEngineArgs.add_cli_args`` (what ``vllm serve`` and ``vllm bench`` build their parser with) calls
  ``load_general_plugins()`` *before* it calls ``EngineArgs.add_cli_args(parser)``; vLLM's own comment there
  says plugins load first so that they can extend the arguments. Our general plugin wraps
  ``EngineArgs.add_cli_args`` to add one argument group after vLLM's own, so the flag is in ``--help``
  (``vllm serve --help=kv-cache-backend``) and parsed like any other.
* ``EngineArgs.from_cli_args`` copies only dataclass fields, so the parsed flag would be dropped: a wrapper
  moves it into ``additional_config["kv_cache_backend"]`` -- vLLM's official channel for out-of-tree
  options, which reaches the engine core and every worker inside ``VllmConfig``.
* The same wrapper resolves the plugin's settings (flag, ``additional_config``, ``ELASTIC_KV_*``) right
  there, in the front end before any engine process exists: a bad setting ends the command with one line
  on stderr that names it and shows a valid value, and exit status 2 (argparse's, for bad arguments),
  instead of a traceback from the engine core seconds later. ``LLM(...)`` callers never pass here; they
  get the same :class:`~elastic_kv.errors.ConfigError` from ``create_engine_config``.

Rejected: a platform plugin's ``pre_register_and_update(parser)`` sees the parser too, but only the one
active platform is called, so the package would have to *become* the platform (replacing CUDA's or CPU's);
an argparse action that writes the environment would hide the choice from ``VllmConfig``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from elastic_kv.errors import ConfigError

from vllm_elastic_kv import compat
from vllm_elastic_kv.config import BACKEND_KEY, Backend, PluginConfig

__all__ = ["EXIT_BAD_SETTING", "FLAG", "GROUP_TITLE", "add_arguments", "merge_backend", "patches"]

FLAG = "--kv-cache-backend"
GROUP_TITLE = "ElasticKV"
_DEST = "kv_cache_backend"
EXIT_BAD_SETTING = 2  # argparse's status for bad arguments: a bad setting is one

_HELP = (
    "Where the KV cache lives. 'native': vLLM's own cache, preallocated at start-up. 'elastic' "
    "(vllm-elastic-kv): the cache reserves virtual memory for its full capacity and backs pages with "
    "physical memory only while blocks are in use, so memory follows load (see `kvctl list`). "
    f"Same as --additional-config.{BACKEND_KEY}=<value>; default: additional_config, then the "
    "ELASTIC_KV_BACKEND environment variable, then 'native'."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``ElasticKV`` argument group with :data:`FLAG` to ``parser`` (once; a second call is a
    no-op, since a parser may be extended by more than one caller)."""
    if any(FLAG in action.option_strings for action in parser._actions):
        return
    group = parser.add_argument_group(
        GROUP_TITLE, description="Elastic KV cache (vllm-elastic-kv plugin): physical memory follows load."
    )
    group.add_argument(FLAG, dest=_DEST, choices=[b.value for b in Backend], default=None, help=_HELP)


def merge_backend(additional_config: Any, backend: str | None) -> Any:
    """``additional_config`` with ``kv_cache_backend`` set to ``backend`` (None: unchanged).

    ConfigError when ``additional_config`` already names a different backend (two conflicting choices on
    one command line), or is an opaque object that cannot carry the option.
    """
    if backend is None:
        return additional_config
    chosen = Backend.parse(backend, FLAG)
    if additional_config is None:
        additional_config = {}
    if not isinstance(additional_config, dict):
        raise ConfigError(f"{FLAG} needs --additional-config to be a dict, got {type(additional_config)}")
    existing = additional_config.get(BACKEND_KEY)
    if existing is not None and Backend.parse(existing, f"additional_config[{BACKEND_KEY!r}]") is not chosen:
        raise ConfigError(
            f"{FLAG}={chosen.value} conflicts with --additional-config {BACKEND_KEY}={existing!r}"
        )
    return {**additional_config, BACKEND_KEY: chosen.value}


def _wrap_add_cli_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        add_arguments(parser)
        return parser

    return add_cli_args


def _wrap_from_cli_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_cli_args(cls: Any, args: argparse.Namespace, *rest: Any, **kwargs: Any) -> Any:
        engine_args = original(cls, args, *rest, **kwargs)
        backend = getattr(args, _DEST, None)
        try:
            if backend is not None:
                engine_args.additional_config = merge_backend(engine_args.additional_config, backend)
            PluginConfig.resolve(engine_args.additional_config, os.environ)
        except ConfigError as exc:
            print(f"vllm-elastic-kv: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_BAD_SETTING) from None
        return engine_args

    return from_cli_args


def patches() -> tuple[compat.Patch, ...]:
    """The two front-end patches that make the flag exist (see the module docstring)."""
    return (
        compat.Patch(
            "cli-flag", compat.target(compat.ARG_UTILS, "EngineArgs.add_cli_args"), _wrap_add_cli_args
        ),
        compat.Patch(
            "cli-to-additional-config",
            compat.target(compat.ARG_UTILS, "EngineArgs.from_cli_args"),
            _wrap_from_cli_args,
        ),
    )
