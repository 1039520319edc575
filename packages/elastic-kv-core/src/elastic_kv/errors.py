"""Error types of elastic-kv.

Each type has exactly one meaning, so callers can decide what to do from the type alone:

* :class:`PoolExhausted` -- physical memory (a limit, the GPU-wide budget or the driver) cannot back
  more pages *right now*. Recoverable: the engine treats it like "no free blocks" and preempts or waits.
* :class:`StateConsistencyError` -- the pool's view and the device's view may disagree (a rollback
  itself failed). The pool refuses further work; the process keeps running.
* :class:`ConfigError` -- a configuration or layout that elastic-kv cannot serve (wrong page size, a
  block larger than a page, an unsupported engine version or model feature). Raised at start-up.

Bad arguments (misaligned offsets, double map, unknown ids) raise the built-in :class:`ValueError`
and leave state unchanged.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ElasticKVError", "PoolExhausted", "StateConsistencyError"]


class ElasticKVError(Exception):
    """Base class of every error elastic-kv raises on purpose (except :class:`ValueError`)."""


class PoolExhausted(ElasticKVError, MemoryError):
    """Physical memory cannot back the request now; nothing was taken. Recoverable."""


class StateConsistencyError(ElasticKVError):
    """A rollback failed; the pool is marked inconsistent and refuses work until it is rebuilt."""


class ConfigError(ElasticKVError, ValueError):
    """A configuration or layout elastic-kv cannot serve; the message says what to change."""
