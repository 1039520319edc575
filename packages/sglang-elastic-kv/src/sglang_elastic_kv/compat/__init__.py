"""Which SGLang versions the plugin supports, and every SGLang member it relies on, checked before an
engine starts.

* :mod:`.versions` -- the supported versions (:data:`SUPPORTED`: SGLang 0.5.23, the versions whose engine
  tests ran end to end) and, for each, its hook targets (:class:`Seams`); :func:`select` refuses any other
  version in one line. 0.5.20-0.5.22 consult the platform's pool and allocator seams only for out-of-tree
  platforms or were not run; before 0.5.12 SGLang has no plugin loader at all.
* :mod:`.members` -- every SGLang member the plugin hooks, subclasses, overrides, calls or reads
  (:data:`MEMBERS`, :data:`INSTANCE_MEMBERS`), and the checks that name a missing one
  (:func:`check_members` at start-up, :func:`check_instance` while SGLang builds the plugin's objects).

:func:`require` is both for a version: the row to hook, or ``ConfigError``. The vLLM plugin's ``compat``
package has the same floor plan.
"""

from __future__ import annotations

from sglang_elastic_kv.compat.members import (
    INSTANCE_MEMBERS,
    MEMBERS,
    check_instance,
    check_members,
    missing_members,
)
from sglang_elastic_kv.compat.versions import (
    CLI_TARGETS,
    SEAMS,
    STARTUP_GUARD,
    SUPPORTED,
    Seams,
    installed_sglang_version,
    select,
)

__all__ = [
    "CLI_TARGETS",
    "INSTANCE_MEMBERS",
    "MEMBERS",
    "SEAMS",
    "STARTUP_GUARD",
    "SUPPORTED",
    "Seams",
    "check_instance",
    "check_members",
    "installed_sglang_version",
    "missing_members",
    "require",
    "select",
]


def require(version: str) -> Seams:
    """:func:`select` and :func:`check_members` for ``version``: the row to hook, or ConfigError."""
    seams = select(version)
    check_members(version)
    return seams
