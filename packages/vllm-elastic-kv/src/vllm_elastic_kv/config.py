"""The plugin's configuration: which KV cache backend an engine uses, and the elastic pool's settings.

Everything the plugin reads comes through :meth:`PluginConfig.resolve`, in this order (first wins):

1. ``VllmConfig.additional_config["kv_cache_backend"]`` -- vLLM's official channel for out-of-tree options;
   ``--kv-cache-backend=elastic`` (see :mod:`vllm_elastic_kv.frontend.cli`) and
   ``LLM(..., additional_config={"kv_cache_backend": "elastic"})`` both end up here;
2. the environment variable ``ELASTIC_KV_BACKEND`` -- for embedded use where the caller cannot reach
   vLLM's arguments (it is inherited by the engine core and every worker);
3. ``native``: vLLM's own KV cache, the plugin does nothing.

Pool settings are :class:`elastic_kv.config.ElasticConfig` fields: ``ELASTIC_KV_*`` environment variables,
overridden by ``additional_config["elastic_kv"]`` (a dict of field names; sizes may be strings such as
``"2M"``). On GPUs three of them, when the user sets neither source (:data:`AUTO_SIZED`), are sized to the
model, the engine and the device instead of taking the core's defaults: the slot size (``page_size``,
:func:`vllm_elastic_kv.layout.pool_geometry`), the minimum reserve (``reserve_min_pages``, one scheduler
step's pages, :func:`vllm_elastic_kv.layout.reserve_min_pages`) and the headroom kept free on each GPU
(``min_free_bytes``, :func:`elastic_kv.device.default_min_free_bytes`). Two settings are the plugin's
own (same two sources):

* ``capacity_bytes`` / ``ELASTIC_KV_CAPACITY`` -- the KV cache's virtual capacity when
  ``--kv-cache-memory-bytes`` is not given (which always wins); 0 = vLLM's own sizing;
* ``idle_cache_bytes`` / ``ELASTIC_KV_IDLE_CACHE`` -- prefix-cache pages an idle engine keeps backed
  (default 0: an idle engine keeps the null block's page and its minimum reserve, ``reserve_min_pages``).

When the front end activates the elastic backend it writes the resolved choice and an engine instance token
into ``additional_config``, so the engine core and the workers, which receive the same
``VllmConfig``, never depend on their environment for the decision.

The environment is read only here, and only from the mapping the caller passes (``os.environ`` in
production, a dict in tests).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from elastic_kv.config import ENV_PREFIX, ElasticConfig, parse_size
from elastic_kv.errors import ConfigError

__all__ = [
    "AUTO_SIZED",
    "BACKEND_ENV",
    "BACKEND_KEY",
    "INSTANCE_KEY",
    "OPTIONS_KEY",
    "Backend",
    "PluginConfig",
]

# additional_config keys: the backend choice, and the dict of pool options.
BACKEND_KEY = "kv_cache_backend"
OPTIONS_KEY = "elastic_kv"
# Key inside OPTIONS_KEY that the front end fills in: the engine instance token (socket and pool names).
INSTANCE_KEY = "instance"
BACKEND_ENV = f"{ENV_PREFIX}BACKEND"
# The plugin's own options: additional_config["elastic_kv"] key -> environment variable.
_PLUGIN_OPTIONS = {"capacity_bytes": f"{ENV_PREFIX}CAPACITY", "idle_cache_bytes": f"{ENV_PREFIX}IDLE_CACHE"}
# Plugin-level environment variables: kept away from ElasticConfig.from_env, which warns on unknown names.
_PLUGIN_ENV = frozenset({BACKEND_ENV, *_PLUGIN_OPTIONS.values()})
# ElasticConfig fields that the plugin sizes on GPUs unless the user sets them -> their variable's suffix.
AUTO_SIZED = {"page_size": "PAGE_SIZE", "reserve_min_pages": "RESERVE_MIN", "min_free_bytes": "MIN_FREE"}
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SIZE_FIELDS = frozenset({"page_size", "limit_bytes", "min_free_bytes"})


class Backend(str, enum.Enum):
    """The KV cache backends ``--kv-cache-backend`` accepts."""

    NATIVE = "native"
    ELASTIC = "elastic"

    @classmethod
    def parse(cls, value: object, source: str) -> Backend:
        """``value`` as a backend; ConfigError naming ``source`` and the accepted values otherwise."""
        if isinstance(value, Backend):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        choices = ", ".join(b.value for b in cls)
        raise ConfigError(f"{source}={value!r} is not a KV cache backend; use one of: {choices}")


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """The resolved choice for one engine (see the module docstring for where each field comes from).

    ``source`` says where the backend came from (``additional_config``, ``environment`` or ``default``);
    ``instance`` is the engine instance token the front end chose when it activated the backend (None
    before activation, and always None for ``native``).
    """

    backend: Backend
    source: str
    elastic: ElasticConfig
    instance: str | None = None
    capacity_bytes: int = 0
    idle_cache_bytes: int = 0
    # The settings among AUTO_SIZED that the user chose (ELASTIC_KV_* or additional_config); on GPUs the
    # plugin sizes the others to the model and the engine (vllm_elastic_kv.layout.pool_geometry and
    # reserve_min_pages).
    chosen: frozenset[str] = frozenset()

    @property
    def enabled(self) -> bool:
        """True when the engine runs with the elastic KV cache."""
        return self.backend is Backend.ELASTIC

    @classmethod
    def resolve(cls, additional_config: object, environ: Mapping[str, str]) -> PluginConfig:
        """Resolve the backend and pool settings from vLLM's ``additional_config`` and ``environ``.

        ``additional_config`` is ``VllmConfig.additional_config`` (a dict, or an opaque object vLLM allows,
        which carries no option of ours). Raises ConfigError for a bad value, naming where it came from.
        """
        options = additional_config if isinstance(additional_config, Mapping) else {}
        if BACKEND_KEY in options:
            backend = Backend.parse(options[BACKEND_KEY], f"additional_config[{BACKEND_KEY!r}]")
            source = "additional_config"
        elif environ.get(BACKEND_ENV, "").strip():
            backend = Backend.parse(environ[BACKEND_ENV], BACKEND_ENV)
            source = "environment"
        else:
            backend = Backend.NATIVE
            source = "default"

        pool_options = options.get(OPTIONS_KEY, {})
        if not isinstance(pool_options, Mapping):
            raise ConfigError(
                f"additional_config[{OPTIONS_KEY!r}] must be a dict of elastic-kv options, "
                f"got {type(pool_options).__name__}"
            )
        instance = pool_options.get(INSTANCE_KEY)
        if instance is not None and not (isinstance(instance, str) and _INSTANCE_RE.match(instance)):
            raise ConfigError(
                f"additional_config[{OPTIONS_KEY!r}][{INSTANCE_KEY!r}]={instance!r} is malformed"
            )
        own = {k for k in pool_options if k in _PLUGIN_OPTIONS or k == INSTANCE_KEY}
        overrides = _pool_overrides({k: v for k, v in pool_options.items() if k not in own})
        pool_env = {k: v for k, v in environ.items() if k not in _PLUGIN_ENV}
        elastic = ElasticConfig.from_env(pool_env, **overrides)
        sizes = {name: _plugin_size(name, pool_options, environ) for name in _PLUGIN_OPTIONS}
        chosen = frozenset(
            name
            for name, env in AUTO_SIZED.items()
            if name in overrides or pool_env.get(f"{ENV_PREFIX}{env}", "").strip()
        )
        return cls(backend=backend, source=source, elastic=elastic, instance=instance, chosen=chosen, **sizes)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, environ: Mapping[str, str]) -> PluginConfig:
        """:meth:`resolve` for a ``VllmConfig`` (any object with ``additional_config``)."""
        return cls.resolve(getattr(vllm_config, "additional_config", None), environ)


def _plugin_size(name: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> int:
    """Plugin option ``name`` from ``additional_config`` (wins) or its environment variable; 0 if unset."""
    env = _PLUGIN_OPTIONS[name]
    if name in options:
        value, source = options[name], f"additional_config[{OPTIONS_KEY!r}][{name!r}]"
    elif environ.get(env, "").strip():
        value, source = environ[env], env
    else:
        return 0
    try:
        size = parse_size(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}={value!r}: {exc}") from None
    if size < 0:
        raise ConfigError(f"{source}={value!r} must be >= 0")
    return size


def _pool_overrides(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``additional_config["elastic_kv"]``: ElasticConfig field names, sizes parsed from strings."""
    known = {f.name for f in fields(ElasticConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        allowed = sorted(known | set(_PLUGIN_OPTIONS))
        raise ConfigError(
            f"additional_config[{OPTIONS_KEY!r}] has unknown option(s) {unknown}; known: {allowed}"
        )
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in _SIZE_FIELDS and isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise ConfigError(f"additional_config[{OPTIONS_KEY!r}][{name!r}]: {exc}") from None
        elif name == "registry_dir" and isinstance(value, str):
            value = Path(value)
        out[name] = value
    return out
