"""The version table of sglang_elastic_kv.compat: every hook target exists in the installed SGLang (this
test fails loudly when a target moves upstream), and versions outside the table are refused clearly."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import pkgutil
from pathlib import Path

import pytest
from elastic_kv.errors import ConfigError
from sglang_elastic_kv import compat

from tests.support.models import REPO_ROOT

pytestmark = pytest.mark.sglang


def test_parse_version() -> None:
    assert compat.parse_version("0.5.23") == (0, 5, 23)
    assert compat.parse_version("0.5.23.post1") == (0, 5, 23)
    assert compat.parse_version("0.6rc0") == (0, 6, 0)
    with pytest.raises(ValueError):
        compat.parse_version("latest")


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23", "0.5.23.post2", "0.5.30"])
def test_supported_versions_select_the_platform_seams(version: str) -> None:
    assert compat.select(version) is compat.SEAMS[0]


@pytest.mark.parametrize(
    ("version", "why"),
    [("0.5.21", "without consulting"), ("0.5.9", "without consulting"), ("0.6.0", "not been verified")],
)
def test_unsupported_versions_are_refused_with_the_reason(version: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        compat.select(version)
    assert version in str(info.value) and ">=0.5.22,<0.6.0" in str(info.value)


def test_every_target_of_the_installed_version_resolves() -> None:
    seams = compat.select(importlib.metadata.version("sglang"))
    for target in (*seams.targets(), *compat.CLI_TARGETS, compat.STARTUP_GUARD):
        obj = pkgutil.resolve_name(target)
        assert callable(obj), target


def test_platform_seam_signatures() -> None:
    from sglang.srt.platforms.interface import SRTPlatform

    seams = compat.select(importlib.metadata.version("sglang"))
    assert list(inspect.signature(pkgutil.resolve_name(seams.kv_pool_cls)).parameters) == ["self", "kind"]
    assert list(inspect.signature(SRTPlatform.get_paged_allocator_cls).parameters) == ["self"]
    builder = inspect.signature(pkgutil.resolve_name(seams.allocator_builder))
    assert {"sizes", "token_to_kv_pool", "token_to_kv_pool_allocator"} <= set(builder.parameters)


def test_in_tree_platforms_inherit_the_seams() -> None:
    """One hook on the base class answers for every in-tree platform only if none overrides them."""
    from sglang.srt.platforms.cpu import CpuSRTPlatform
    from sglang.srt.platforms.cuda import CudaSRTPlatform
    from sglang.srt.platforms.interface import SRTPlatform
    from sglang.srt.platforms.rocm import RocmSRTPlatform

    for cls in (CpuSRTPlatform, CudaSRTPlatform, RocmSRTPlatform):
        assert cls.get_kv_pool_cls is SRTPlatform.get_kv_pool_cls, cls
        assert cls.get_paged_allocator_cls is SRTPlatform.get_paged_allocator_cls, cls


WHEEL_0522 = REPO_ROOT / ".cache" / "sglang-wheels" / "0.5.22" / "sglang"


def _defines(path: Path, qualname: str) -> bool:
    """Whether ``path`` defines ``Class.method`` or ``function`` (read in a test only)."""
    tree = ast.parse(path.read_text())
    head, _, tail = qualname.partition(".")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == head and tail:
            return any(isinstance(n, ast.FunctionDef) and n.name == tail for n in node.body)
        if isinstance(node, ast.FunctionDef) and node.name == head and not tail:
            return True
    return False


@pytest.mark.skipif(not WHEEL_0522.exists(), reason="sglang 0.5.22 not unpacked in .cache/sglang-wheels")
def test_targets_exist_in_0_5_22_source() -> None:
    seams = compat.select("0.5.22")
    for target in (*seams.targets(), *compat.CLI_TARGETS):
        module, qual = _split(target)
        path = WHEEL_0522.parent / (module.replace(".", "/") + ".py")
        assert _defines(path, qual), target


def _split(target: str) -> tuple[str, str]:
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        if (WHEEL_0522.parent / ("/".join(parts[:i]) + ".py")).exists():
            return ".".join(parts[:i]), ".".join(parts[i:])
    raise AssertionError(f"no module for {target}")
