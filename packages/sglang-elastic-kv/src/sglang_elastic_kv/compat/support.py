"""The support rule: which installed SGLang the elastic backend serves, checked at start-up (:func:`select`).

* An *engine-verified* version (its :class:`~sglang_elastic_kv.compat.versions.Seams` row has
  ``verified="engine"``) is served when the installed SGLang has every hook target of its row, each starting
  with the parameters its hook reads, and every member of
  :data:`~sglang_elastic_kv.compat.members.MEMBERS`.
* A *source-verified* version is served on the same condition, and one warning line says that no engine
  test has run on it.
* Any other version is refused with one :class:`~elastic_kv.errors.ConfigError` line naming the first
  symbol that does not match the row of the newest supported version below it (or, when every symbol
  matches, the command that checks the release's source); a supported version whose installed package does
  not match its row is refused in one line naming every symbol that does not.
"""

from __future__ import annotations

import functools
import inspect
import logging
import multiprocessing
import pkgutil

from elastic_kv.errors import ConfigError

from sglang_elastic_kv.compat.members import missing_members
from sglang_elastic_kv.compat.versions import Seams, row_for, supported_text, verified_versions

__all__ = ["mismatches", "select"]

logger = logging.getLogger("sglang_elastic_kv.compat")


def _hook_problem(target: str, params: tuple[str, ...]) -> str | None:
    """What is wrong with hook target ``target`` in the installed SGLang (None: it is a function whose
    parameters start with ``params``)."""
    owner_name, _, name = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_name)
    except Exception as exc:  # any release: a module that fails to import lacks the target too
        return f"{target}: missing ({exc})"
    try:
        obj = inspect.getattr_static(owner, name)
    except AttributeError:
        return f"{target}: missing"
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        have = tuple(inspect.signature(func).parameters)  # a hook's wrapper reports the original's
    except (TypeError, ValueError):
        return f"{target}: not a function"
    if have[: len(params)] != params:
        return f"{target}: parameters {have}, expected to start with {params}"
    return None


def mismatches(row: Seams) -> list[str]:
    """Every symbol of ``row`` and of ``MEMBERS`` that the installed SGLang does not have as declared
    (``"dotted: what differs"``), hook targets first; imports their owners."""
    problems = [problem for target, params in row.hooked() if (problem := _hook_problem(target, params))]
    targets = set(row.targets())
    return problems + [f"{member}: missing" for member in missing_members() if member not in targets]


def select(version: str) -> Seams:
    """The row serving the installed SGLang, whose version is ``version``; ConfigError in one line otherwise
    (see the module docstring). On a source-verified version, warns once, in the process that starts the
    engine (the schedulers and the detokenizer it spawns load the plugin again and stay quiet)."""
    version = version.strip()
    row = row_for(version)
    problems = mismatches(row)
    if version not in row.versions:
        first = (
            f"first mismatch against {row.label}: {problems[0]}"
            if problems
            else (
                f"every symbol of the {row.label} row matches, but no row has been checked against its "
                f"source (python ci/sglang_compat_check.py {version})"
            )
        )
        raise ConfigError(
            f"--kv-cache-backend=elastic does not support sglang {version}: supported {supported_text()} "
            f"({first}); install a supported version or use --kv-cache-backend=native"
        )
    if problems:
        raise ConfigError(
            f"--kv-cache-backend=elastic: sglang {version} does not have what the plugin relies on: "
            f"{'; '.join(problems)} (supported: {supported_text()})"
        )
    if row.verified == "source" and multiprocessing.parent_process() is None:
        _warn_source_verified(version)
    return row


@functools.cache
def _warn_source_verified(version: str) -> None:
    logger.warning(
        "sglang-elastic-kv: sglang %s is source-verified: every SGLang symbol the plugin relies on matches "
        "the %s release's source, but no engine test has run on it (engine-verified: %s)",
        version,
        version,
        ", ".join(verified_versions("engine")),
    )
