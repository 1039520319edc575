"""Everything the plugin relies on in vLLM, in one place, checked before an engine starts.

* :mod:`.versions` -- the supported releases (:data:`SUPPORT`) and every vLLM function, method, class and
  rebound module-level name the plugin calls, overrides, wraps or rebinds (:class:`Target`, checked by
  signature: :func:`check_installed`);
* :mod:`.members` -- every attribute, field and instance member it reads or sets (:data:`MEMBERS`,
  :data:`INSTANCE_MEMBERS`, :data:`ADDED_ATTRIBUTES`; :data:`PROBED` for those read with a fallback);
* :mod:`.patches` -- the few patches it makes (:class:`Patch`, :func:`apply_patch`, :func:`scoped_attribute`);
* :mod:`.support` -- the support rule (:func:`accept`): engine-verified and source-verified releases.

Activation (:func:`vllm_elastic_kv.frontend.activation.activate`) calls :func:`accept`, which checks both
tables against the installed vLLM and refuses in one line naming the version and the first symbol that does
not match. ``ci/compat_check.py`` runs the same check on a release's source without installing it.
``docs/upstream/vllm.md`` lists the same dependencies for vLLM's maintainers, with the extension points that
would retire them.
"""

from vllm_elastic_kv.compat.members import (
    ADDED_ATTRIBUTES,
    CPU_MEMBERS,
    INSTANCE_MEMBERS,
    MEMBERS,
    MEMBERS_BY_ALLOCATION,
    PROBED,
    check_instance,
    missing_members,
)
from vllm_elastic_kv.compat.patches import PATCH_MARKER, Patch, apply_patch, patched_symbols, scoped_attribute
from vllm_elastic_kv.compat.support import accept, mismatches
from vllm_elastic_kv.compat.versions import (
    ARG_UTILS,
    SUPPORT,
    Target,
    Version,
    VersionSupport,
    check_installed,
    installed_version,
    nearest_entry,
    parse_version,
    resolve,
    support_for,
    supported_ranges,
    target,
)

__all__ = [
    "ADDED_ATTRIBUTES",
    "ARG_UTILS",
    "CPU_MEMBERS",
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
    "accept",
    "apply_patch",
    "check_installed",
    "check_instance",
    "installed_version",
    "mismatches",
    "missing_members",
    "nearest_entry",
    "parse_version",
    "patched_symbols",
    "resolve",
    "scoped_attribute",
    "support_for",
    "supported_ranges",
    "target",
]
