"""Everything the plugin relies on in vLLM, in one place, checked before an engine starts.

* :mod:`.versions` -- the supported releases (:data:`SUPPORT`) and every vLLM function, method, class and
  rebound module-level name the plugin calls, overrides, wraps or rebinds (:class:`Target`, checked by
  signature: :func:`check_installed`);
* :mod:`.members` -- every attribute, field and instance member it reads or sets (:data:`MEMBERS`,
  :data:`INSTANCE_MEMBERS`, :data:`ADDED_ATTRIBUTES`; :data:`PROBED` for those read with a fallback);
* :mod:`.patches` -- the few patches it makes (:class:`Patch`, :func:`apply_patch`, :func:`scoped_attribute`).

Activation (:func:`vllm_elastic_kv.activation.activate`) checks both tables against the installed vLLM and
fails with one line naming the version and every missing member. ``docs/upstream/vllm.md`` lists the same
dependencies for vLLM's maintainers, with the extension points that would retire them.
"""

from vllm_elastic_kv.compat.members import (
    ADDED_ATTRIBUTES,
    INSTANCE_MEMBERS,
    MEMBERS,
    MEMBERS_BY_ALLOCATION,
    PROBED,
    check_instance,
    missing_members,
)
from vllm_elastic_kv.compat.patches import PATCH_MARKER, Patch, apply_patch, patched_symbols, scoped_attribute
from vllm_elastic_kv.compat.versions import (
    ARG_UTILS,
    SUPPORT,
    Target,
    Version,
    VersionSupport,
    check_installed,
    installed_version,
    parse_version,
    resolve,
    support_for,
    target,
)

__all__ = [
    "ADDED_ATTRIBUTES",
    "ARG_UTILS",
    "INSTANCE_MEMBERS",
    "MEMBERS",
    "MEMBERS_BY_ALLOCATION",
    "PATCH_MARKER",
    "PROBED",
    "SUPPORT",
    "Patch",
    "Target",
    "Version",
    "VersionSupport",
    "apply_patch",
    "check_installed",
    "check_instance",
    "installed_version",
    "missing_members",
    "parse_version",
    "patched_symbols",
    "resolve",
    "scoped_attribute",
    "support_for",
    "target",
]
