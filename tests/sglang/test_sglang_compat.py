"""The version table of sglang_elastic_kv.compat: every hook target exists in the installed SGLang (this
test fails loudly when a target moves upstream), and versions outside the table are refused clearly."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import pkgutil

import pytest
from elastic_kv.errors import ConfigError
from sglang_elastic_kv import compat
from sglang_elastic_kv.compat import members as compat_members

from tests.support.models import REPO_ROOT

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("version", ["0.5.23", " 0.5.23 "])
def test_the_version_the_tests_ran_is_supported(version: str) -> None:
    assert compat.select(version) is compat.SEAMS[0]


@pytest.mark.parametrize(
    "version", ["0.5.22", "0.5.21", "0.5.9", "0.5.23.post1", "0.5.24", "0.5.30", "0.6.0"]
)
def test_every_other_version_is_refused_in_one_line(version: str) -> None:
    with pytest.raises(ConfigError) as info:
        compat.select(version)
    text = str(info.value)
    assert "\n" not in text
    assert f"sglang {version}:" in text and "supported engine-verified 0.5.23" in text


def test_installed_sglang_has_every_member() -> None:
    assert compat.missing_members() == []
    assert compat.mismatches(compat.row_for(importlib.metadata.version("sglang"))) == []


def test_a_missing_member_is_named_with_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    members = {
        **compat.MEMBERS,
        "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator": ("_gone_in_this_version",),
        "sglang.srt.mem_cache.no_such_module": ("X",),
    }
    monkeypatch.setattr(compat_members, "MEMBERS", members)
    with pytest.raises(ConfigError) as info:
        compat.select("0.5.23")
    text = str(info.value)
    assert "\n" not in text and "sglang 0.5.23 does not have what the plugin relies on" in text
    assert "SWATokenToKVPoolAllocator._gone_in_this_version: missing" in text
    assert "sglang.srt.mem_cache.no_such_module: missing" in text


def test_an_instance_without_a_listed_attribute_is_refused() -> None:
    owner = "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool"

    class Half:
        full_kv_pool = None

    with pytest.raises(ConfigError, match=r"SWAKVPool instances lack swa_kv_pool"):
        compat.check_instance(Half(), owner)


def _private_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(private attribute names read or called in ``tree``, names ``tree`` defines or assigns itself)."""
    used: set[str] = set()
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute):
                    own.add(target.attr)
                elif isinstance(target, ast.Name):
                    own.add(target.id)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            used.add(node.attr)
    return used, own


def test_every_private_member_the_plugin_uses_is_listed() -> None:
    """Every private name of SGLang's that the plugin's source calls, overrides or reads is in the table."""
    listed = {name for names in compat.MEMBERS.values() for name in names}
    listed |= {name for names in compat.INSTANCE_MEMBERS.values() for name in names}
    used: set[str] = set()
    own: set[str] = set()
    for path in (REPO_ROOT / "packages" / "sglang-elastic-kv" / "src" / "sglang_elastic_kv").rglob("*.py"):
        more_used, more_own = _private_names(ast.parse(path.read_text()))
        used |= more_used
        own |= more_own
    # argparse's option table (the CLI hook) is not SGLang's.
    foreign = {"_option_string_actions"}
    # An override defines the name too: it must still be listed (it is SGLang's method).
    overridden = {
        "_create_buffers",
        "_create_buffers_normal",
        "_release_page_ids",
        "_available_and_evictable",
    }
    assert sorted(((used - own - foreign) | overridden) - listed) == []


def test_every_target_of_the_installed_version_resolves() -> None:
    seams = compat.select(importlib.metadata.version("sglang"))
    members = {f"{owner}.{name}" for owner, names in compat.MEMBERS.items() for name in names}
    for target in (*seams.targets(), *compat.CLI_TARGETS, compat.STARTUP_GUARD):
        assert target in members, target
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
