"""An engine release's Python source, read without installing or importing it: what the compat checks share.

``ci/compat_check.py`` (vLLM) and ``ci/sglang_compat_check.py`` (SGLang) each list the symbols their plugin
relies on; this module finds them in a release's source and prints the result:

* :class:`Source` -- the ``PACKAGE/**.py`` files of one release (its wheel, downloaded once into
  ``.cache/wheels``, or a folder), each parsed with ``ast`` on demand;
* :func:`lookup`, :func:`member_state`, :func:`settable_state`, :func:`function_state` -- one symbol's
  :class:`State` in a release: present as declared, or what is there instead (missing, moved to another
  module, other parameters);
* :class:`Row` and :func:`main` -- the one table both checks print (what moved or changed against a
  reference release), the summary line and the exit status.

Nothing here is specific to an engine: a module, class or member is found the way Python would find it
(a module's own bindings and its ``from x import y``; a class's body, its bases in the same source, and for
instance members what its methods set on ``self``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Protocol

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEELS = REPO_ROOT / ".cache" / "wheels"
# CPython 3.12 on x86-64 Linux; vLLM publishes manylinux_2_28 wheels, SGLang manylinux_2_34 ones.
PIP_PLATFORM = (
    "--python-version",
    "3.12",
    "--only-binary=:all:",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_34_x86_64",
)
_VERSION_RE = re.compile(r"^\d+\.\d+")

__all__ = [
    "WHEELS",
    "Check",
    "Labelled",
    "Row",
    "Source",
    "SourceUnavailable",
    "State",
    "calls_in_order",
    "function_state",
    "lookup",
    "main",
    "member_function_state",
    "member_state",
    "moved",
    "open_source",
    "settable_state",
    "use_checkout",
    "wheel",
]


def use_checkout(*packages: str) -> None:
    """Make this checkout's ``packages/<name>/src`` importable, after any installed copy (so an installed
    plugin is what is checked)."""
    for name in packages:
        path = str(REPO_ROOT / "packages" / name / "src")
        if path not in sys.path:
            sys.path.append(path)


class SourceUnavailable(Exception):
    """The release's source could not be found or fetched (no network, index down, no such version)."""


# --- reading a release's source --------------------------------------------------------------------
class Source:
    """The ``package/**.py`` files of one release, from a wheel (zip) or a folder, parsed on demand."""

    def __init__(self, path: Path, package: str) -> None:
        self.path = path
        self.package = package
        self._files: dict[str, str] = {}  # dotted module -> file name (in the zip or under the folder)
        if path.is_file():
            self._zip: zipfile.ZipFile | None = zipfile.ZipFile(path)
            names = [n for n in self._zip.namelist() if n.startswith(f"{package}/") and n.endswith(".py")]
            self._root = path
        else:
            self._zip = None
            self._root = path if (path / package).is_dir() else path.parent
            if not (self._root / package).is_dir():
                raise SourceUnavailable(f"{path} holds no {package}/ package")
            names = [str(p.relative_to(self._root)) for p in (self._root / package).rglob("*.py")]
        for name in names:
            dotted = name[: -len(".py")].replace("/", ".")
            self._files[dotted.removesuffix(".__init__")] = name
        self._trees: dict[str, ast.Module | None] = {}
        self._defining: dict[str, list[str]] = {}
        self.version = self._version()

    def _read(self, name: str) -> bytes:
        if self._zip is not None:
            return self._zip.read(name)
        return (self._root / name).read_bytes()

    def module(self, dotted: str) -> ast.Module | None:
        """The AST of module ``dotted`` (``None`` if the release has no such module)."""
        if dotted not in self._trees:
            name = self._files.get(dotted)
            self._trees[dotted] = None if name is None else ast.parse(self._read(name))
        return self._trees[dotted]

    def is_package(self, dotted: str) -> bool:
        return self._files.get(dotted, "").endswith("__init__.py")

    def defining(self, name: str) -> list[str]:
        """Modules with a top-level ``def name`` / ``class name`` (where a missing symbol moved to)."""
        if name not in self._defining:
            needles = (f"def {name}(".encode(), f"class {name}(".encode(), f"class {name}:".encode())
            found = []
            for dotted, file in sorted(self._files.items()):
                data = self._read(file)
                if any(n in data for n in needles):
                    tree = self.module(dotted)
                    if tree is not None and _find(tree.body, name) is not None:
                        found.append(dotted)
            self._defining[name] = found
        return self._defining[name]

    def _version(self) -> str:
        tree = self.module(f"{self.package}._version") or self.module(f"{self.package}.version")
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in targets):
                    return str(node.value.value)
        return self.path.name


def wheel(package: str, version: str) -> Path:
    """The cached wheel of ``package`` (a distribution of that name) ``version``, downloaded once
    (SourceUnavailable on failure)."""
    found = sorted(WHEELS.glob(f"{package}-{version}-*.whl"))
    if found:
        return found[0]
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM, "-d", str(WHEELS)]
    try:
        subprocess.run([*cmd, f"{package}=={version}"], check=True, capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        raise SourceUnavailable(f"cannot fetch {package}=={version} ({exc})") from exc
    found = sorted(WHEELS.glob(f"{package}-{version}-*.whl"))
    if not found:
        raise SourceUnavailable(f"pip download {package}=={version} left no wheel in {WHEELS}")
    return found[0]


def installed_source(package: str) -> Path | None:
    """The folder holding the installed ``package`` (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


@cache
def open_source(package: str, release: str) -> Source:
    """A :class:`Source` of ``package`` for ``release``: a version (its wheel), a ``.whl`` file, a folder, or
    ``installed``; ValueError for something that is none of them."""
    if release == "installed":
        folder = installed_source(package)
        if folder is None:
            raise SourceUnavailable(f"no installed {package}")
        return Source(folder, package)
    path = Path(release)
    if path.exists():
        return Source(path, package)
    if not _VERSION_RE.match(release):
        raise ValueError(f"{release!r} is neither a path nor a {package} version")
    return Source(wheel(package, release), package)


# --- looking symbols up --------------------------------------------------------------------------
_Def = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a module or class body, looking into ``if`` / ``try`` blocks (conditional defs)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(block)
        else:
            yield node


def _find(body: list[ast.stmt], name: str) -> _Def | None:
    for node in _top_level(body):
        if isinstance(node, _Def) and node.name == name:
            return node
    return None


def _bound_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Every name a module or class body binds -> the statement that binds it. A ``def`` or ``class`` is
    kept over a later assignment to its name (``X = wrap(X)``, ``X = msgspec.defstruct(..., vars(X))``): the
    definition says more about what the name holds."""
    names: dict[str, ast.stmt] = {}
    for node in _top_level(body):
        if isinstance(node, _Def):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):  # a, (b, c) = ...; not X.attr = ... nor d[k] = ...
                    stored = isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
                    if stored and not isinstance(names.get(sub.id), _Def):
                        names[sub.id] = node
    return names


def _import_source(src: Source, module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` imports from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not src.is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(src: Source, module: str, name: str, depth: int = 0) -> tuple[str, ast.stmt] | None:
    """(module, statement) that defines ``name`` as seen from ``module``, following ``from x import y`` and
    ``from x import *``."""
    tree = src.module(module)
    if tree is None or depth > 8:
        return None
    node = _bound_names(tree.body).get(name)
    if isinstance(node, ast.ImportFrom):
        origin = _import_source(src, module, node)
        real = next(a.name for a in node.names if (a.asname or a.name) == name)
        if src.module(f"{origin}.{real}") is not None:
            return f"{origin}.{real}", node  # a submodule
        return _resolve(src, origin, real, depth + 1) or (origin, node)
    if node is None:
        stars = (n for n in _top_level(tree.body) if isinstance(n, ast.ImportFrom) and n.names[0].name == "*")
        found = (_resolve(src, _import_source(src, module, n), name, depth + 1) for n in stars)
        return next((f for f in found if f is not None), None)
    return module, node


def _owner(src: Source, dotted: str) -> tuple[str, ast.Module | ast.ClassDef] | None:
    """The module or class ``dotted`` names, as (module it is defined in, node)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        tree = src.module(module)
        if tree is None:
            continue
        node: ast.Module | ast.ClassDef = tree
        for part in parts[cut:]:
            found = _resolve(src, module, part) if isinstance(node, ast.Module) else None
            if found is None and isinstance(node, ast.ClassDef):
                inner = _find(node.body, part)
                found = (module, inner) if inner is not None else None
            if found is None or not isinstance(found[1], ast.ClassDef):
                return None
            module, node = found[0], found[1]  # type: ignore[assignment]
        return module, node
    return None


def _lineage(src: Source, module: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
    """``cls`` (defined in ``module``), then each of its bases found in the source, depth first."""
    yield module, cls
    for base in cls.bases:
        expr = base.value if isinstance(base, ast.Subscript) else base
        found = _resolve(src, module, expr.id) if isinstance(expr, ast.Name) else None
        if found is not None and isinstance(found[1], ast.ClassDef):
            yield from _lineage(src, found[0], found[1])


def _member(
    src: Source, module: str, owner: ast.Module | ast.ClassDef, name: str
) -> tuple[str, ast.stmt] | None:
    """(module, statement) binding ``name`` on ``owner`` (a module: its own binding, imports followed; a
    class: its body or a base's)."""
    if isinstance(owner, ast.Module):
        return _resolve(src, module, name)
    for where, cls in _lineage(src, module, owner):
        node = _bound_names(cls.body).get(name)
        if node is not None:
            return where, node
    return None


def _self_assigned(cls: ast.ClassDef) -> set[str]:
    """The attributes ``cls``'s methods set on ``self`` (``self.a = ...``, ``self.a, self.b = ...``)."""
    names: set[str] = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return names


def _has_member(
    src: Source, module: str, owner: ast.Module | ast.ClassDef, name: str, instance: bool
) -> bool:
    """Whether ``owner`` (a module, or a class with its bases) has member ``name``; with ``instance``,
    attributes its methods set on ``self`` count too."""
    if _member(src, module, owner, name) is not None:
        return True
    return (
        instance
        and isinstance(owner, ast.ClassDef)
        and any(name in _self_assigned(cls) for _, cls in _lineage(src, module, owner))
    )


def _slots(cls: ast.ClassDef) -> bool:
    if "__slots__" in _bound_names(cls.body):
        return True
    return any(
        isinstance(d, ast.Call) and any(k.arg == "slots" and getattr(k.value, "value", 0) for k in d.keywords)
        for d in cls.decorator_list
    )


def lookup(src: Source, module: str, qualname: str) -> _Def | None:
    """The class/function definition ``qualname`` of ``module`` (``A.b`` looks inside class ``A``)."""
    tree = src.module(module)
    if tree is None:
        return None
    node: _Def | None = None
    body: list[ast.stmt] = tree.body
    for part in qualname.split("."):
        node = _find(body, part)
        if node is None:
            return None
        body = node.body
    return node


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        names.append(f"*{args.vararg.arg}")
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append(f"**{args.kwarg.arg}")
    return tuple(names)


def calls_in_order(node: ast.AST, names: tuple[str, ...]) -> bool:
    """True when ``node``'s body calls functions/methods named ``names`` (last dotted part), in that
    order (other calls may come between)."""
    seen = [
        call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        for call in sorted(
            (n for n in ast.walk(node) if isinstance(n, ast.Call)), key=lambda c: (c.lineno, c.col_offset)
        )
    ]
    position = 0
    for name in seen:
        if position < len(names) and name == names[position]:
            position += 1
    return position == len(names)


# --- one symbol's state in a release ---------------------------------------------------------------
@dataclass(frozen=True)
class State:
    """A symbol in one release: ``ok`` (as declared), and what is there (parameters, where it moved)."""

    ok: bool
    text: str


def moved(src: Source, name: str, what: str) -> str:
    """``what``, and the modules that define a top-level ``name`` now, if any."""
    where = src.defining(name)
    return f"{what}; defined in {', '.join(where)}" if where else what


def function_state(node: ast.stmt, params: tuple[str, ...] | None) -> State:
    """``node`` as a function whose parameters start with ``params`` (``self``/``cls`` included; None:
    any): its parameters, or what it is instead."""
    if isinstance(node, ast.ClassDef):
        return State(False, "a class, not a function")
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return State(False, f"bound by {type(node).__name__}, not a def")
    have = _params(node)
    ok = params is None or have[: len(params)] == params
    return State(ok, f"({', '.join(have)})")


def member_state(src: Source, dotted: str, instance: bool = False) -> State:
    """Member ``dotted`` (``owner.name``, the owner a module or class) in ``src``: present, or missing
    (with where a missing owner or module-level name is defined now)."""
    owner_name, _, name = dotted.rpartition(".")
    found = _owner(src, owner_name)
    if found is None:
        return State(False, moved(src, owner_name.rpartition(".")[2], f"owner {owner_name} missing"))
    if _has_member(src, found[0], found[1], name, instance):
        return State(True, "present")
    return State(False, moved(src, name, "missing") if isinstance(found[1], ast.Module) else "missing")


def settable_state(src: Source, owner_name: str) -> State:
    found = _owner(src, owner_name)
    if found is None or not isinstance(found[1], ast.ClassDef):
        return State(False, "class missing")
    return State(not _slots(found[1]), "settable" if not _slots(found[1]) else "__slots__: not settable")


def member_function_state(src: Source, dotted: str, params: tuple[str, ...] | None) -> State:
    """Function or method ``dotted`` (``owner.name``; a method may be inherited) in ``src``, its
    parameters starting with ``params``: see :func:`function_state`."""
    owner_name, _, name = dotted.rpartition(".")
    found = _owner(src, owner_name)
    member = None if found is None else _member(src, found[0], found[1], name)
    if member is None:
        return State(False, member_state(src, dotted).text)
    return function_state(member[1], params)


# --- the table ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One symbol: what it is, its state in the release and (None without one) in the reference;
    ``required`` is False for a probed member, whose absence is never an error."""

    symbol: str
    kind: str
    release: State
    reference: State | None
    required: bool = True

    @property
    def problem(self) -> bool:
        return self.required and not self.release.ok

    @property
    def changed(self) -> bool:
        return self.problem or (self.reference is not None and self.reference != self.release)


def _table(rows: list[Row], engine: str, release: str, reference: str | None) -> str:
    header = ["symbol", "kind", *([f"{engine} {reference}"] if reference else []), f"{engine} {release}"]
    lines = [
        [
            r.symbol,
            r.kind,
            *([r.reference.text] if r.reference else []),
            ("" if r.release.ok or not r.required else "NO: ") + r.release.text,
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in lines]
    return "\n".join(out)


# Given a release's source and the reference's (None without one): what the release is checked against
# ("the 0.34 entry") and one Row per symbol.
class Labelled(Protocol):
    """What a check matched a release against: an entry or row of the plugin's table, named by its label."""

    @property
    def label(self) -> str: ...


# A release's check: what it was matched against and one Row per symbol.
Check = Callable[[Source, Source | None], tuple[Labelled, list[Row]]]


def main(
    argv: list[str] | None, *, prog: str, doc: str, package: str, engine: str, check: Check, table: str
) -> int:
    """A compat check's command line (``prog``, described by the first paragraph of ``doc``; ``table``: what
    ``check`` matches a release against, "entry" or "row", as its verdict names it): ``RELEASE
    [--against REF] [--all]``. Prints the table of what moved or changed (every row with ``--all``) and one
    summary line naming the first symbol that does not match. Exit status 0: every symbol matches; 1: one
    does not; 2: bad arguments or no source."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument(
        "release", help=f"a {engine} version (its released wheel), a .whl file or a source folder"
    )
    parser.add_argument("--against", default="installed", help="the reference release (default: installed)")
    parser.add_argument("--all", action="store_true", help="print every symbol, not only what changed")
    args = parser.parse_args(argv)
    try:
        src = open_source(package, args.release)
    except (SourceUnavailable, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    reference: Source | None = None
    if args.against != "none":
        try:
            reference = open_source(package, args.against)
        except (SourceUnavailable, ValueError) as exc:
            print(f"{prog}: no reference ({exc})", file=sys.stderr)
    matched, rows = check(src, reference)
    checked = f"the {matched.label} {table}"
    shown = rows if args.all else [r for r in rows if r.changed]
    if shown:
        print(_table(shown, engine, src.version, reference.version if reference else None))
    problems = [r for r in rows if r.problem]
    changed = sum(r.changed for r in rows)
    verdict = (
        f"{checked} matches"
        if not problems
        else f"{checked} does not match: first {problems[0].symbol} ({problems[0].release.text})"
    )
    print(f"{engine} {src.version}: {len(rows)} symbols checked, {changed} moved or changed; {verdict}")
    return 1 if problems else 0
