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

Wheels are fetched with ``pip download --no-deps --only-binary=:all:`` for CPython 3.12 on
manylinux_2_28_x86_64 into ``.cache/wheels`` (ignored by git), about 250-350 MB each; only ``vllm/**.py``
is read from the zip.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
for _src in ("elastic-kv-core", "vllm-elastic-kv"):
    _path = str(REPO_ROOT / "packages" / _src / "src")
    if _path not in sys.path:
        sys.path.append(_path)  # after any installed copy, so an installed plugin is what is checked

from vllm_elastic_kv.compat import (  # noqa: E402
    ADDED_ATTRIBUTES,
    CPU_MEMBERS,
    INSTANCE_MEMBERS,
    MEMBERS,
    MEMBERS_BY_ALLOCATION,
    PROBED,
    SUPPORT,
    Target,
    VersionSupport,
    parse_version,
)

WHEELS = REPO_ROOT / ".cache" / "wheels"
PIP_PLATFORM = ("--python-version", "3.12", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64")

__all__ = [
    "WHEELS",
    "Row",
    "Source",
    "SourceUnavailable",
    "calls_in_order",
    "check_release",
    "entry_for",
    "lookup",
    "main",
    "open_source",
    "wheel",
]


class SourceUnavailable(Exception):
    """The release's source could not be found or fetched (no network, index down, no such version)."""


# --- reading a release's source --------------------------------------------------------------------
class Source:
    """The ``vllm/**.py`` files of one release, from a wheel (zip) or a folder; modules parsed on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._files: dict[str, str] = {}  # dotted module -> file name (in the zip or under the folder)
        if path.is_file():
            self._zip: zipfile.ZipFile | None = zipfile.ZipFile(path)
            names = [n for n in self._zip.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            self._root = path
        else:
            self._zip = None
            self._root = path if (path / "vllm").is_dir() else path.parent
            if not (self._root / "vllm").is_dir():
                raise SourceUnavailable(f"{path} holds no vllm/ package")
            names = [str(p.relative_to(self._root)) for p in (self._root / "vllm").rglob("*.py")]
        for name in names:
            dotted = name[: -len(".py")].replace("/", ".")
            self._files[dotted.removesuffix(".__init__")] = name
        self._trees: dict[str, ast.Module | None] = {}
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
        needles = (f"def {name}(".encode(), f"class {name}(".encode(), f"class {name}:".encode())
        found = []
        for dotted, file in sorted(self._files.items()):
            data = self._read(file)
            if any(n in data for n in needles):
                tree = self.module(dotted)
                if tree is not None and _find(tree.body, name) is not None:
                    found.append(dotted)
        return found

    def _version(self) -> str:
        tree = self.module("vllm._version") or self.module("vllm.version")
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in targets):
                    return str(node.value.value)
        return self.path.name


def wheel(version: str) -> Path:
    """The cached vLLM ``version`` wheel, downloaded once (SourceUnavailable on failure)."""
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM, "-d", str(WHEELS)]
    try:
        subprocess.run([*cmd, f"vllm=={version}"], check=True, capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        raise SourceUnavailable(f"cannot fetch vllm=={version} ({exc})") from exc
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SourceUnavailable(f"pip download vllm=={version} left no wheel in {WHEELS}")
    return found[0]


def installed_source() -> Path | None:
    """The folder holding the installed vLLM (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


@cache
def open_source(release: str) -> Source:
    """A :class:`Source` for ``release``: a version (its wheel), a ``.whl`` file, a folder, or
    ``installed``."""
    if release == "installed":
        folder = installed_source()
        if folder is None:
            raise SourceUnavailable("no installed vLLM")
        return Source(folder)
    path = Path(release)
    if path.exists():
        return Source(path)
    parse_version(release)  # ValueError for something that is neither a path nor a version
    return Source(wheel(release))


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
    """Every name a module or class body binds -> the statement that binds it."""
    names: dict[str, ast.stmt] = {}
    for node in _top_level(body):
        if isinstance(node, _Def):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names[sub.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
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
    """(module, statement) that defines ``name`` as seen from ``module``, following ``from x import``."""
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
    return None if node is None else (module, node)


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


def _self_assigned(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


def _has_member(
    src: Source, module: str, owner: ast.Module | ast.ClassDef, name: str, instance: bool
) -> bool:
    """Whether ``owner`` (a module, or a class with its vLLM bases) has member ``name``; with ``instance``,
    attributes its methods set on ``self`` count too."""
    if name in _bound_names(owner.body):
        return True
    if isinstance(owner, ast.Module):
        return False
    if instance and name in _self_assigned(owner):
        return True
    for base in owner.bases:
        expr = base.value if isinstance(base, ast.Subscript) else base
        found = _resolve(src, module, expr.id) if isinstance(expr, ast.Name) else None
        if (
            found is not None
            and isinstance(found[1], ast.ClassDef)
            and _has_member(src, found[0], found[1], name, instance)
        ):
            return True
    return False


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


def target_state(src: Source, target: Target) -> State:
    """``target`` in ``src``: present with the declared kind and leading parameters, or what differs."""
    tree = src.module(target.module)
    top = target.qualname.split(".")[0]
    if target.kind == "name":
        if tree is not None and top in _bound_names(tree.body):
            return State(True, "bound")
        return State(False, _moved(src, top, "not bound"))
    node = lookup(src, target.module, target.qualname)
    if node is None:
        return State(False, _moved(src, top, "missing" if tree is not None else "module missing"))
    if target.kind == "class":
        return State(
            isinstance(node, ast.ClassDef), "class" if isinstance(node, ast.ClassDef) else "not a class"
        )
    if isinstance(node, ast.ClassDef):
        return State(False, "a class, not a function")
    have = _params(node)
    ok = target.params is None or have[: len(target.params)] == target.params
    return State(ok, f"({', '.join(have)})")


def _moved(src: Source, name: str, what: str) -> str:
    where = src.defining(name)
    return f"{what}; defined in {', '.join(where)}" if where else what


def member_state(src: Source, dotted: str, instance: bool = False) -> State:
    owner_name, _, name = dotted.rpartition(".")
    found = _owner(src, owner_name)
    if found is None:
        return State(False, f"owner {owner_name} missing")
    ok = _has_member(src, found[0], found[1], name, instance)
    return State(ok, "present" if ok else "missing")


def settable_state(src: Source, owner_name: str) -> State:
    found = _owner(src, owner_name)
    if found is None or not isinstance(found[1], ast.ClassDef):
        return State(False, "class missing")
    return State(not _slots(found[1]), "settable" if not _slots(found[1]) else "__slots__: not settable")


# --- the check -----------------------------------------------------------------------------------
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


def entry_for(version: tuple[int, int, int]) -> VersionSupport:
    """The entry covering ``version``, else the newest one below it (the one a new release is checked
    against), else the oldest."""
    covering = [e for e in SUPPORT if e.covers(version)]
    if covering:
        return covering[0]
    below = [e for e in SUPPORT if e.lo <= version[:2]]
    return max(below, key=lambda e: e.lo) if below else SUPPORT[0]


def symbols(entry: VersionSupport) -> Iterator[tuple[str, str, bool, object]]:
    """(symbol, kind, required, how to check it) for every symbol ``entry`` relies on."""
    for target in entry.targets:
        yield str(target), target.kind, True, target
    module, _, func = entry.get_kv_cache_configs.partition(":")
    yield f"{module}.{func}", "function", True, Target(module, func)
    for table in (MEMBERS, CPU_MEMBERS, MEMBERS_BY_ALLOCATION[entry.kv_allocation]):
        for owner, names in table.items():
            for name in names:
                yield f"{owner}.{name}", "member", True, ("member", f"{owner}.{name}")
    for owner, names in INSTANCE_MEMBERS.items():
        for name in names:
            yield f"{owner}.{name}", "instance member", True, ("instance", f"{owner}.{name}")
    for owner in ADDED_ATTRIBUTES:
        yield owner, "takes attributes", True, ("settable", owner)
    for dotted in PROBED:
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
    """The entry that serves ``src``'s release and one :class:`Row` per symbol it relies on."""
    entry = entry_for(parse_version(src.version))
    rows = [
        Row(symbol, kind, _state(src, how), _state(reference, how) if reference else None, required)
        for symbol, kind, required, how in symbols(entry)
    ]
    return entry, rows


def _table(rows: list[Row], release: str, reference: str | None) -> str:
    header = ["symbol", "kind", *([f"vLLM {reference}"] if reference else []), f"vLLM {release}"]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("release", help="a vLLM version (its released wheel), a .whl file or a source folder")
    parser.add_argument("--against", default="installed", help="the reference release (default: installed)")
    parser.add_argument("--all", action="store_true", help="print every symbol, not only what changed")
    args = parser.parse_args(argv)
    try:
        src = open_source(args.release)
    except (SourceUnavailable, ValueError) as exc:
        print(f"compat_check: {exc}", file=sys.stderr)
        return 2
    reference: Source | None = None
    if args.against != "none":
        try:
            reference = open_source(args.against)
        except (SourceUnavailable, ValueError) as exc:
            print(f"compat_check: no reference ({exc})", file=sys.stderr)
    entry, rows = check_release(src, reference)
    shown = rows if args.all else [r for r in rows if r.changed]
    if shown:
        print(_table(shown, src.version, reference.version if reference else None))
    problems = [r for r in rows if r.problem]
    changed = sum(r.changed for r in rows)
    verdict = (
        f"the {entry.label} entry matches"
        if not problems
        else f"the {entry.label} entry does not match: first {problems[0].symbol} "
        f"({problems[0].release.text})"
    )
    print(f"vLLM {src.version}: {len(rows)} symbols checked, {changed} moved or changed; {verdict}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
