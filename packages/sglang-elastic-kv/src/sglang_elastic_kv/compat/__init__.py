"""Which SGLang versions the plugin supports, and every SGLang member it relies on, checked before an
engine starts.

* :mod:`.versions` -- the supported versions and, for each, its hook targets (:data:`SEAMS`, one
  :class:`Seams` row per set of versions, engine-verified or source-verified; :data:`HOOK_PARAMS`, the
  parameters each hook reads). 0.5.20-0.5.22 consult the platform's pool and allocator seams only for
  out-of-tree platforms or were not run; before 0.5.12 SGLang has no plugin loader at all.
* :mod:`.members` -- every SGLang member the plugin hooks, subclasses, overrides, calls or reads
  (:data:`MEMBERS`, :data:`INSTANCE_MEMBERS`), and :func:`check_instance`, which names a missing instance
  member while SGLang builds the plugin's objects.
* :mod:`.support` -- the support rule (:func:`select`): the row to hook for the installed SGLang, a warning
  line on a source-verified version, or ``ConfigError`` in one line naming the first symbol that does not
  match.

``ci/sglang_compat_check.py`` runs the same check on a release's source without installing it. The vLLM
plugin's ``compat`` package has the same floor plan.
"""

from __future__ import annotations

from sglang_elastic_kv.compat.members import (
    INSTANCE_MEMBERS,
    MEMBERS,
    check_instance,
    missing_members,
)
from sglang_elastic_kv.compat.support import mismatches, select
from sglang_elastic_kv.compat.versions import (
    CLI_TARGETS,
    HOOK_PARAMS,
    SEAMS,
    STARTUP_GUARD,
    Seams,
    installed_sglang_version,
    row_for,
)

__all__ = [
    "CLI_TARGETS",
    "HOOK_PARAMS",
    "INSTANCE_MEMBERS",
    "MEMBERS",
    "SEAMS",
    "STARTUP_GUARD",
    "Seams",
    "check_instance",
    "installed_sglang_version",
    "mismatches",
    "missing_members",
    "row_for",
    "select",
]
