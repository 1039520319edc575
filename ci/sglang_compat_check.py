"""Check an SGLang release's source against the SGLang plugin's compat tables, without installing or running.

    python ci/sglang_compat_check.py 0.5.23                  # the released wheel (downloaded once, cached)
    python ci/sglang_compat_check.py path/to/sglang-X.whl    # a local wheel
    python ci/sglang_compat_check.py path/to/site-packages   # a source folder holding sglang/
    python ci/sglang_compat_check.py 0.5.24 --against 0.5.23 --all

For the row that would serve the release (:func:`sglang_elastic_kv.compat.row_for`: its own, else the row of
the newest supported version below it), every hook target of the row (a function or method, inherited or
not, whose parameters start with the ones its hook reads: ``compat.HOOK_PARAMS``), every member of
``compat.MEMBERS`` and every instance member of ``compat.INSTANCE_MEMBERS`` is looked up in the release's
``sglang/**.py`` (``ast``; nothing is imported). The script prints one table of every symbol that is
missing, moved (with the module that defines it now) or changed against the reference release
(``--against``: by default the installed SGLang's own source, when there is one), then one summary line.
``--all`` prints every row. Exit status 0: the row matches the release (every symbol as declared); 1:
something does not, and the first such symbol is the summary line's; 2: bad arguments or no source.

A new SGLang release that matches costs one row in ``compat.SEAMS`` (``verified="source"``);
``tests/sglang/test_sglang_compat_source.py`` runs the same check for every supported version. The wheel
(about 40 MB) is fetched like vLLM's into ``.cache/wheels`` and read by ``ci/compat_source.py``, which
``ci/compat_check.py`` shares.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator

from compat_source import (  # ci/, next to this file
    Row,
    Source,
    State,
    member_function_state,
    member_state,
    use_checkout,
)
from compat_source import main as check_main

use_checkout("elastic-kv-core", "sglang-elastic-kv")

from sglang_elastic_kv.compat import INSTANCE_MEMBERS, MEMBERS, Seams, row_for  # noqa: E402

__all__ = ["check_release", "main"]

# Class -> the module-level list (in the class's module) of the classes SGLang assembles its fields from at
# import: ``ServerArgs`` is rebuilt by ``msgspec.defstruct`` from the ``arg_groups.fields`` namespace structs
# that ``_INPUT_NAMESPACES`` lists, so each of its fields is declared on one of those, not in its body.
COMPOSED = {"sglang.srt.server_args.ServerArgs": "_INPUT_NAMESPACES"}


def symbols(row: Seams) -> Iterator[tuple[str, str, tuple[str, ...] | None]]:
    """(symbol, kind, leading parameters for a hook target else None) for every symbol ``row`` relies on;
    a hook target is listed once, as a hook target, although ``MEMBERS`` names it too."""
    hooked = dict(row.hooked())
    for target, params in hooked.items():
        yield target, "hook target", params
    for owner, names in MEMBERS.items():
        for name in names:
            if f"{owner}.{name}" not in hooked:
                yield f"{owner}.{name}", "member", None
    for owner, names in INSTANCE_MEMBERS.items():
        for name in names:
            yield f"{owner}.{name}", "instance member", None


def _parts(src: Source, owner: str) -> list[str]:
    """The names in the list ``COMPOSED[owner]`` of ``owner``'s module (empty when there is none)."""
    module = owner.rpartition(".")[0]
    tree = src.module(module)
    for node in tree.body if tree is not None else ():
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == COMPOSED[owner] for t in node.targets)
            and isinstance(node.value, (ast.List, ast.Tuple))
        ):
            return [f"{module}.{e.id}" for e in node.value.elts if isinstance(e, ast.Name)]
    return []


def _state(src: Source, symbol: str, kind: str, params: tuple[str, ...] | None) -> State:
    if kind == "hook target":
        return member_function_state(src, symbol, params)
    state = member_state(src, symbol, instance=kind == "instance member")
    owner, _, name = symbol.rpartition(".")
    if state.ok or owner not in COMPOSED:
        return state
    part = next((p for p in _parts(src, owner) if member_state(src, f"{p}.{name}").ok), None)
    return state if part is None else State(True, f"present (a field of {part.rpartition('.')[2]})")


def check_release(src: Source, reference: Source | None = None) -> tuple[Seams, list[Row]]:
    """The row that serves ``src``'s release and one :class:`Row` per symbol it relies on."""
    row = row_for(src.version)
    rows = [
        Row(
            symbol,
            kind,
            _state(src, symbol, kind, params),
            _state(reference, symbol, kind, params) if reference else None,
        )
        for symbol, kind, params in symbols(row)
    ]
    return row, rows


def main(argv: list[str] | None = None) -> int:
    return check_main(
        argv,
        prog="sglang_compat_check",
        doc=__doc__ or "",
        package="sglang",
        engine="SGLang",
        check=check_release,
        table="row",
    )


if __name__ == "__main__":
    sys.exit(main())
