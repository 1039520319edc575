"""Check a vLLM release's source against the plugin's compat tables, without installing or running it.

    python ci/compat_check.py 0.34.0                 # the released wheel (downloaded once, cached)
    python ci/compat_check.py path/to/vllm-X.whl     # a local wheel
    python ci/compat_check.py path/to/site-packages  # a source folder holding vllm/
    python ci/compat_check.py 0.35.0 --against 0.34.0 --all

For the compat entry that would serve the release (:data:`vllm_elastic_kv.compat.SUPPORT`: the entry
covering it, else the newest one below it), every :class:`~vllm_elastic_kv.compat.Target` (by signature),
``get_kv_cache_configs`` and every member of :mod:`vllm_elastic_kv.compat.members` is looked up in the
release's Python source (``ast``; nothing is imported). The script prints one table of every symbol that
is missing, moved (with the module that defines it now) or changed against the reference release
(``--against``: by default the installed vLLM's own source, when there is one), then one summary line.
``--all`` prints every row. Exit status 0: the entry matches the release (every target and member as
declared); 1: something does not, and the first such symbol is the summary line's; 2: bad arguments or no
source.

A new vLLM release costs one compat entry: run this on it, give moved symbols their new place in a new
entry (a shim where a signature changed), and run ``tests/vllm/test_vllm_compat.py``, which runs the same
check for every supported release.

Wheels are fetched with ``pip download --no-deps --only-binary=:all:`` for CPython 3.12 on x86-64 Linux
into ``.cache/wheels`` (ignored by git), about 250-350 MB each; only ``vllm/**.py`` is read from the zip.
The source is read by ``ci/compat_source.py``, which ``ci/sglang_compat_check.py`` shares.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator

from compat_source import (  # ci/, next to this file
    Row,
    Source,
    State,
    function_state,
    lookup,
    member_state,
    moved,
    settable_state,
    use_checkout,
)
from compat_source import main as check_main

use_checkout("elastic-kv-core", "vllm-elastic-kv")

from vllm_elastic_kv import compat  # noqa: E402
from vllm_elastic_kv.compat import Target, VersionSupport  # noqa: E402

__all__ = ["check_release", "main"]


# --- the check -----------------------------------------------------------------------------------
def target_state(src: Source, target: Target) -> State:
    """``target`` in ``src``: present with the declared kind and leading parameters, or what differs."""
    top = target.qualname.split(".")[0]
    if target.kind == "name":
        if member_state(src, f"{target.module}.{top}").ok:
            return State(True, "bound")
        return State(False, moved(src, top, "not bound"))
    node = lookup(src, target.module, target.qualname)
    if node is None:
        return State(False, moved(src, top, "missing" if src.module(target.module) else "module missing"))
    if target.kind == "class":
        return State(
            isinstance(node, ast.ClassDef), "class" if isinstance(node, ast.ClassDef) else "not a class"
        )
    return function_state(node, target.params)


def symbols(entry: VersionSupport) -> Iterator[tuple[str, str, bool, object]]:
    """(symbol, kind, required, how to check it) for every symbol ``entry`` relies on."""
    for target in entry.targets:
        yield str(target), target.kind, True, target
    module, _, func = entry.get_kv_cache_configs.partition(":")
    yield f"{module}.{func}", "function", True, Target(module, func)
    for table in (compat.MEMBERS, compat.CPU_MEMBERS, compat.MEMBERS_BY_ALLOCATION[entry.kv_allocation]):
        for owner, names in table.items():
            for name in names:
                yield f"{owner}.{name}", "member", True, ("member", f"{owner}.{name}")
    for owner, names in compat.INSTANCE_MEMBERS.items():
        for name in names:
            yield f"{owner}.{name}", "instance member", True, ("instance", f"{owner}.{name}")
    for owner in compat.ADDED_ATTRIBUTES:
        yield owner, "takes attributes", True, ("settable", owner)
    for dotted in compat.PROBED:
        yield dotted, "probed member", False, ("instance", dotted)


def _state(src: Source, how: object) -> State:
    if isinstance(how, Target):
        return target_state(src, how)
    assert isinstance(how, tuple)
    kind, dotted = how
    if kind == "settable":
        return settable_state(src, dotted)
    return member_state(src, dotted, instance=kind == "instance")


def check_release(src: Source, reference: Source | None = None) -> tuple[VersionSupport, list[Row]]:
    """The entry that serves ``src``'s release (:func:`~vllm_elastic_kv.compat.nearest_entry`: the one
    covering it, else the newest one below it) and one :class:`Row` per symbol it relies on."""
    entry = compat.nearest_entry(compat.parse_version(src.version))
    rows = [
        Row(symbol, kind, _state(src, how), _state(reference, how) if reference else None, required)
        for symbol, kind, required, how in symbols(entry)
    ]
    return entry, rows


def main(argv: list[str] | None = None) -> int:
    return check_main(
        argv,
        prog="compat_check",
        doc=__doc__ or "",
        package="vllm",
        engine="vLLM",
        check=check_release,
        table="entry",
    )


if __name__ == "__main__":
    sys.exit(main())
