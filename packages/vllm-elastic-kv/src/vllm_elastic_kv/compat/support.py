"""The support rule: which installed vLLM the elastic backend serves, checked once in the front end.

* An *engine-verified* release (``VersionSupport.verified == "engine"``) is served when every target and
  member of its entry resolves in the installed vLLM.
* A *source-verified* release is served on the same condition, and one warning line says that no engine
  test has run on it.
* Any other release -- one with no entry, or one whose installed package lacks a symbol its entry
  declares -- is refused with one :class:`~elastic_kv.errors.ConfigError` line naming the first symbol that
  does not match (for a release without an entry: the first against the newest entry below it).
"""

from __future__ import annotations

import functools
import logging

from elastic_kv.errors import ConfigError

from vllm_elastic_kv.compat.members import missing_members
from vllm_elastic_kv.compat.versions import (
    SUPPORT,
    Version,
    VersionSupport,
    check_installed,
    installed_version,
    nearest_entry,
    supported_ranges,
)

__all__ = ["accept", "mismatches"]

logger = logging.getLogger("vllm_elastic_kv.compat")


def mismatches(entry: VersionSupport) -> list[str]:
    """Every symbol of ``entry`` that the installed vLLM does not have as declared, targets first."""
    targets = (*entry.targets, entry.get_kv_cache_configs_target)
    problems = check_installed(VersionSupport(entry.lo, entry.hi, entry.kv_allocation, "", targets))
    return problems + [f"{member}: missing" for member in missing_members(entry)]


def accept(version: Version | None = None) -> VersionSupport:
    """The entry that serves the installed vLLM (``version``: its version, read when None); ConfigError in
    one line otherwise (see the module docstring). Warns once per process on a source-verified release."""
    version = installed_version() if version is None else version
    text = ".".join(map(str, version))
    entry = nearest_entry(version)
    problems = mismatches(entry)
    if not entry.covers(version):
        first = (
            f"first mismatch against the {entry.label} entry: {problems[0]}"
            if problems
            else (
                f"every symbol of the {entry.label} entry matches, but no entry has been checked against it "
                f"(python ci/compat_check.py {text})"
            )
        )
        raise ConfigError(
            f"vllm-elastic-kv supports vLLM {supported_ranges()}; this is vLLM {text} ({first}). "
            "Use --kv-cache-backend=native, or install a supported vLLM."
        )
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"vllm-elastic-kv: vLLM {text} does not have what the {entry.label} support expects: "
            f"{problems[0]}{more}. Use --kv-cache-backend=native, or install a supported vLLM."
        )
    if entry.verified == "source":
        _warn_source_verified(text, entry.label)
    return entry


@functools.cache
def _warn_source_verified(version: str, label: str) -> None:
    logger.warning(
        "vllm-elastic-kv: vLLM %s is source-verified: every vLLM symbol the plugin relies on matches the "
        "%s release's source, but no engine test has run on it (engine-verified: %s)",
        version,
        label,
        ", ".join(e.label for e in SUPPORT if e.verified == "engine"),
    )
