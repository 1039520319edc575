"""One typed, frozen configuration object for an elastic KV pool.

:class:`ElasticConfig` is built once (by an engine plugin, a test, or :meth:`ElasticConfig.from_env`) and
passed down; nothing else in elastic-kv reads the environment. Every field is validated at construction,
so a bad value fails at start-up with a :class:`~elastic_kv.errors.ConfigError` that names the variable
and the fix, never later on the allocation path.

Environment variables (all optional, prefix ``ELASTIC_KV_``)::

    ELASTIC_KV_PAGE_SIZE          slot size of every space, e.g. 2M (default 2 MiB, the CUDA granularity)
    ELASTIC_KV_MAX_PAGE_SLOTS     most slots one logical page may span to keep blocks from straddling (8)
    ELASTIC_KV_RESERVE_MIN        pages always kept mapped and free when the limit allows (1; the vLLM
                                  plugin sizes it to one scheduler step on GPUs)
    ELASTIC_KV_RESERVE_MAX        cap on mapped free pages; more are unmapped (16)
    ELASTIC_KV_RESERVE_WINDOW     maintenance steps of growth history that size the reserve (32)
    ELASTIC_KV_PREMAP             1/0: refill the reserve on the data plane's background thread (1)
    ELASTIC_KV_DEFER_RELEASE      1/0: emptied pages wait for release_through(epoch) before unmapping (0)
    ELASTIC_KV_LIMIT              physical limit of the pool, e.g. 8G; 0 = no limit of its own (0)
    ELASTIC_KV_MIN_FREE           device memory never taken by growth, e.g. 1G (0; on GPUs the engine
                                  plugins default to max(2.5 GiB, 2% of the device): elastic_kv.device)
    ELASTIC_KV_FREE_MEMORY_TTL_S  seconds a driver free-memory reading stays valid (0.05)
    ELASTIC_KV_PUBLISH_INTERVAL_S seconds between two snapshots published to the shared record (0.1)
    ELASTIC_KV_REGISTRY_DIR       directory of the shared pool records (default: the registry's own)
    ELASTIC_KV_POOL_NAME          name of the pool's shared record (default: chosen by the engine plugin)
    ELASTIC_KV_START_WAIT_S       seconds a new pool waits for room (a limit or a budget that neighbours
                                  fill) to back its first page, before it gives up (60)
    ELASTIC_KV_HOST_ARENA         a host arena file (elastic_kv.host) where the engine keeps its weights
                                  while asleep; set by ``elastic-kv serve`` (default: none)
    ELASTIC_KV_PARK_KV            1/0: a sleep that keeps its requests parks their KV in host memory and
                                  brings it back on wake-up, for engines whose weights do not change while
                                  asleep; set by ``elastic-kv serve`` (0: the engine's own behaviour)
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from elastic_kv.errors import ConfigError
from elastic_kv.sizes import parse_size

__all__ = ["ENV_PREFIX", "ElasticConfig", "parse_size"]

logger = logging.getLogger(__name__)

ENV_PREFIX = "ELASTIC_KV_"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use 1/0, true/false)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticConfig:
    """Everything a pool needs to know that is not the engine's layout (see the module docstring).

    Invariants (checked in ``__post_init__``): sizes are non-negative, ``page_size`` is a positive multiple
    of 4 KiB, ``reserve_min_pages <= reserve_max_pages``, ``max_page_slots >= 1``.
    """

    page_size: int = 2 << 20
    max_page_slots: int = 8
    reserve_min_pages: int = 1
    reserve_max_pages: int = 16
    reserve_window: int = 32
    premap: bool = True
    defer_release: bool = False
    limit_bytes: int = 0
    min_free_bytes: int = 0
    free_memory_ttl_s: float = 0.05
    publish_interval_s: float = 0.1
    registry_dir: Path | None = None
    pool_name: str | None = None
    start_wait_s: float = 60.0
    host_arena: Path | None = None
    park_kv: bool = False

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size % 4096:
            raise ConfigError(
                f"page_size={self.page_size} must be a positive multiple of 4 KiB and of the backend's "
                f"granularity (2 MiB on CUDA): set {ENV_PREFIX}PAGE_SIZE, e.g. 2M"
            )
        if self.max_page_slots < 1:
            raise ConfigError(
                f"max_page_slots={self.max_page_slots} must be >= 1 ({ENV_PREFIX}MAX_PAGE_SLOTS)"
            )
        if self.reserve_min_pages < 0 or self.reserve_max_pages < self.reserve_min_pages:
            raise ConfigError(
                f"need 0 <= reserve_min_pages ({self.reserve_min_pages}) <= reserve_max_pages "
                f"({self.reserve_max_pages}): set {ENV_PREFIX}RESERVE_MIN / {ENV_PREFIX}RESERVE_MAX"
            )
        if self.reserve_window < 1:
            raise ConfigError(
                f"reserve_window={self.reserve_window} must be >= 1 ({ENV_PREFIX}RESERVE_WINDOW)"
            )
        for name in ("limit_bytes", "min_free_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("free_memory_ttl_s", "publish_interval_s", "start_wait_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value} must be a finite number >= 0")
        if self.pool_name is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", self.pool_name):
            raise ConfigError(
                f"pool_name={self.pool_name!r}: use 1-64 characters from letters, digits and _.:- "
                f"({ENV_PREFIX}POOL_NAME)"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> ElasticConfig:
        """Build a config from ``ELASTIC_KV_*`` variables of ``environ`` (pass ``os.environ`` explicitly).

        ``overrides`` (field names) win over the environment. A variable that cannot be parsed, or whose
        value the checks of the fields refuse, raises :class:`ConfigError` naming it and its value; an
        unknown ``ELASTIC_KV_*`` variable is logged as a warning (a typo must not pass silently, but other
        elastic-kv components may add variables of their own).
        """
        parsers: dict[str, tuple[str, Any]] = {
            "PAGE_SIZE": ("page_size", parse_size),
            "MAX_PAGE_SLOTS": ("max_page_slots", int),
            "RESERVE_MIN": ("reserve_min_pages", int),
            "RESERVE_MAX": ("reserve_max_pages", int),
            "RESERVE_WINDOW": ("reserve_window", int),
            "PREMAP": ("premap", _parse_bool),
            "DEFER_RELEASE": ("defer_release", _parse_bool),
            "LIMIT": ("limit_bytes", parse_size),
            "MIN_FREE": ("min_free_bytes", parse_size),
            "FREE_MEMORY_TTL_S": ("free_memory_ttl_s", float),
            "PUBLISH_INTERVAL_S": ("publish_interval_s", float),
            "REGISTRY_DIR": ("registry_dir", Path),
            "POOL_NAME": ("pool_name", str),
            "START_WAIT_S": ("start_wait_s", float),
            "HOST_ARENA": ("host_arena", Path),
            "PARK_KV": ("park_kv", _parse_bool),
        }
        values: dict[str, Any] = {}
        given: dict[str, str] = {}  # field -> "VARIABLE='text'" for the fields the environment set
        for key, text in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            suffix = key[len(ENV_PREFIX) :]
            if suffix not in parsers:
                logger.warning("ignoring unknown environment variable %s", key)
                continue
            field_name, parse = parsers[suffix]
            try:
                values[field_name] = parse(text)
            except ValueError as exc:
                raise ConfigError(f"{key}={text!r}: {exc}") from None
            given[field_name] = f"{key}={text!r}"
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown ElasticConfig fields: {sorted(unknown)}")
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:
            # Say which variable (and value) the rejected field came from, as for a parse error.
            message = str(exc)
            sources = [given[name] for name in given if name not in overrides and f"{name}=" in message]
            if not sources:
                raise
            raise ConfigError(f"{', '.join(sources)}: {message}") from None
