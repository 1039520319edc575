"""The few patches the plugin makes to vLLM, each on a :class:`~vllm_elastic_kv.compat.versions.Target`.

Patches (:func:`apply_patch`) are idempotent: the replacement carries a marker attribute naming the patch,
and applying a patch whose marker is already in place does nothing. :func:`patched_symbols` lists the
markers in place, which is how tests prove that an installed but disabled plugin changed nothing.
:func:`scoped_attribute` rebinds a module-level name only while vLLM constructs one object.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from elastic_kv.errors import ConfigError

from vllm_elastic_kv.compat.versions import SUPPORT, Target, VersionSupport, check_installed, resolve

__all__ = ["PATCH_MARKER", "Patch", "apply_patch", "patched_symbols", "scoped_attribute"]

logger = logging.getLogger("vllm_elastic_kv.compat")

PATCH_MARKER = "__elastic_kv_patch__"


@dataclass(frozen=True, slots=True)
class Patch:
    """Replace method ``attr`` of class ``target`` with ``wrap(original)``.

    ``wrap`` receives the original *function* (unwrapped from ``staticmethod``/``classmethod``) and returns
    the replacement function; the descriptor type of the original is kept.
    """

    name: str
    target: Target
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]


def _owner_and_attr(target: Target) -> tuple[Any, str]:
    owner_path, _, attr = target.qualname.rpartition(".")
    owner: Any = importlib.import_module(target.module)
    for part in owner_path.split(".") if owner_path else ():
        owner = getattr(owner, part)
    return owner, attr


def apply_patch(patch: Patch) -> bool:
    """Install ``patch``; False (and nothing changed) when it is already installed.

    Raises ConfigError when the target moved: a patch is never applied to something that does not look
    like what it was written for.
    """
    problems = check_installed(VersionSupport((0, 0), (99, 0), "one_buffer", "", (patch.target,)))
    if problems:
        raise ConfigError(f"vllm-elastic-kv cannot patch {patch.target}: {'; '.join(problems)}")
    owner, attr = _owner_and_attr(patch.target)
    current = inspect.getattr_static(owner, attr)
    func = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    if getattr(func, PATCH_MARKER, None) == patch.name:
        return False
    replacement = functools.wraps(func)(patch.wrap(func))
    setattr(replacement, PATCH_MARKER, patch.name)
    if isinstance(current, staticmethod):
        setattr(owner, attr, staticmethod(replacement))
    elif isinstance(current, classmethod):
        setattr(owner, attr, classmethod(replacement))
    else:
        setattr(owner, attr, replacement)
    logger.debug("patched %s (%s)", patch.target, patch.name)
    return True


def patched_symbols(targets: tuple[Target, ...] | None = None) -> list[str]:
    """``"<target>: <patch name>"`` for every target (default: every target of every supported version)
    that currently carries a patch marker of this plugin. Targets that do not import are skipped."""
    if targets is None:
        seen: dict[str, Target] = {}
        for entry in SUPPORT:
            for target in entry.targets:
                seen.setdefault(str(target), target)
        targets = tuple(seen.values())
    found: list[str] = []
    for target in targets:
        if target.kind != "function":
            continue
        try:
            obj = resolve(target)
        except (ImportError, AttributeError):
            continue
        func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        marker = getattr(func, PATCH_MARKER, None)
        if marker is not None:
            found.append(f"{target}: {marker}")
    return found


@contextlib.contextmanager
def scoped_attribute(target: Target, value: Any) -> Iterator[None]:
    """Rebind module-level name ``target`` to ``value`` for the duration of the block, then restore it.

    Used while vLLM constructs one object (the scheduler's KV cache manager and block pool), so that vLLM's
    own construction code builds our subclass; nothing outside the block sees the change. ConfigError when
    the name is not there (the target moved).
    """
    if target.kind != "name" or "." in target.qualname:
        raise ValueError(f"{target} is not a module-level name")
    module = importlib.import_module(target.module)
    if not hasattr(module, target.qualname):
        raise ConfigError(f"vllm-elastic-kv: {target} is missing in this vLLM ({target.why})")
    original = getattr(module, target.qualname)
    setattr(module, target.qualname, value)
    try:
        yield
    finally:
        setattr(module, target.qualname, original)
