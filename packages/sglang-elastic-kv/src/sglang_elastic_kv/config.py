"""The plugin's configuration: one typed object, read once from the environment and passed down.

SGLang gives a plugin no server-argument API and starts its schedulers as ``spawn`` children, so the
choice made on the command line (``--kv-cache-backend=elastic``, see :mod:`sglang_elastic_kv.cli`) or
by an ``sglang.Engine(...)`` user travels in the environment, which every child inherits::

    ELASTIC_KV_SGLANG_BACKEND          native | elastic (default native: the plugin does nothing)
    ELASTIC_KV_SGLANG_TOKEN_CHUNK      page_size 1 only: SGLang token slots per ledger block (default 64)
    ELASTIC_KV_SGLANG_MAX_CACHED_TOKENS  radix-cache bound: tokens the prefix cache may keep once the
                                         requests that wrote them finished; 0 = no bound (default 0)
    ELASTIC_KV_SGLANG_MAINTAIN_INTERVAL_S  least time between two runs of the ledger's housekeeping on
                                         the scheduler's step path (default 0.01; 0 = every step)

Every other ``ELASTIC_KV_*`` variable belongs to the pool itself (:class:`elastic_kv.config.ElasticConfig`,
page size, limit, reserve ...); :meth:`PluginConfig.pool_config` hands exactly those over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from elastic_kv.errors import ConfigError

if TYPE_CHECKING:
    from elastic_kv.config import ElasticConfig

__all__ = ["BACKEND_ENV", "PREFIX", "Backend", "PluginConfig"]

PREFIX = "ELASTIC_KV_SGLANG_"
BACKEND_ENV = PREFIX + "BACKEND"
Backend = Literal["native", "elastic"]
BACKENDS: tuple[Backend, ...] = ("native", "elastic")


_Number = TypeVar("_Number", int, float)


def _number(
    environ: Mapping[str, str], name: str, default: _Number, parse: Callable[[str], _Number], what: str
) -> _Number:
    """``name``'s value read with ``parse``, ``default`` when unset or blank; ConfigError saying the text
    is not ``what`` when ``parse`` refuses it."""
    text = environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        return parse(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not {what}") from None


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    value = _number(environ, name, default, float, "a number of seconds")
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{name}={value} must be a finite number >= 0")
    return value


def _int(environ: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    value = _number(environ, name, default, int, "an integer")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True, kw_only=True)
class PluginConfig:
    """What the SGLang plugin was asked to do, validated once.

    ``enabled`` is True only for ``backend == "elastic"``; a disabled config makes :func:`register`
    register no memory hook at all. ``pool_environ`` holds the ``ELASTIC_KV_*`` variables that are not
    the plugin's own, for :meth:`pool_config`.
    """

    backend: Backend = "native"
    token_chunk: int = 64
    max_cached_tokens: int = 0
    maintain_interval_s: float = 0.01
    pool_environ: Mapping[str, str] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """True when SGLang's KV cache should be elastic."""
        return self.backend == "elastic"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PluginConfig:
        """Read the plugin's variables from ``environ`` (pass ``os.environ``); ConfigError on a bad value."""
        backend = environ.get(BACKEND_ENV, "native").strip().lower() or "native"
        if backend not in BACKENDS:
            raise ConfigError(f"{BACKEND_ENV}={backend!r}: choose one of {', '.join(BACKENDS)}")
        return cls(
            backend=backend,  # checked against BACKENDS just above
            token_chunk=_int(environ, PREFIX + "TOKEN_CHUNK", 64, 1),
            max_cached_tokens=_int(environ, PREFIX + "MAX_CACHED_TOKENS", 0, 0),
            maintain_interval_s=_seconds(environ, PREFIX + "MAINTAIN_INTERVAL_S", 0.01),
            pool_environ={
                k: v for k, v in environ.items() if k.startswith("ELASTIC_KV_") and not k.startswith(PREFIX)
            },
        )

    def pool_config(self, **overrides: object) -> ElasticConfig:
        """The pool's :class:`~elastic_kv.config.ElasticConfig` from the pool's own variables."""
        from elastic_kv.config import ElasticConfig

        return ElasticConfig.from_env(self.pool_environ, **overrides)
