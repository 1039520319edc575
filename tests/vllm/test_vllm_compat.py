"""The compat table against the installed vLLM (signatures) and against every supported release's source.

If vLLM moves or renames anything the plugin relies on, one of these fails and names the target. The source
checks are ``ci/compat_check.py``'s, on each release's wheel (downloaded once into ``.cache/wheels``, about
300 MB each; skipped with the reason when it cannot be fetched). By hand:
``python ci/compat_check.py 0.34.0``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import sys
import textwrap
from pathlib import Path

import pytest
from elastic_kv.errors import ConfigError
from vllm_elastic_kv import compat

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ci"))
from compat_check import check_release
from compat_source import Source, SourceUnavailable, calls_in_order, lookup, open_source

pytestmark = pytest.mark.vllm


def test_parse_version() -> None:
    assert compat.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert compat.parse_version("0.33.0rc1") == (0, 33, 0)
    assert compat.parse_version("0.26") == (0, 26, 0)
    with pytest.raises(ValueError):
        compat.parse_version("dev")


@pytest.mark.parametrize(
    ("version", "allocation", "configs"),
    [
        ((0, 26, 0), "per_tensor", "vllm.v1.core.kv_cache_utils:get_kv_cache_configs"),
        ((0, 26, 9), "per_tensor", "vllm.v1.core.kv_cache_utils:get_kv_cache_configs"),
        ((0, 32, 0), "one_buffer", "vllm.v1.core.kv_cache_utils:get_kv_cache_configs"),
        ((0, 32, 3), "one_buffer", "vllm.v1.core.kv_cache_utils:get_kv_cache_configs"),
        ((0, 33, 0), "one_buffer", "vllm.v1.core.kv_cache_planning:get_kv_cache_configs"),
        ((0, 34, 0), "one_buffer", "vllm.v1.core.kv_cache_planning:get_kv_cache_configs"),
    ],
)
def test_version_table(version: compat.Version, allocation: str, configs: str) -> None:
    entry = compat.support_for(version)
    assert entry.kv_allocation == allocation
    assert entry.get_kv_cache_configs == configs


_RANGES = r"supports vLLM engine-verified 0\.26, 0\.32; source-verified 0\.33, 0\.34; this is vLLM "


def test_each_release_is_engine_or_source_verified() -> None:
    assert {e.label: e.verified for e in compat.SUPPORT} == {
        "0.26": "engine",
        "0.32": "engine",
        "0.33": "source",
        "0.34": "source",
    }


@pytest.mark.parametrize("version", [(0, 25, 2), (0, 27, 0), (0, 29, 0), (0, 31, 1), (0, 35, 0), (1, 0, 0)])
def test_unsupported_version_is_a_clear_config_error(version: compat.Version) -> None:
    """Only the releases of the table are accepted, also between them."""
    with pytest.raises(ConfigError, match=_RANGES):
        compat.support_for(version)


def test_a_release_without_an_entry_is_refused_in_one_line() -> None:
    """Checked against the newest entry below it: the installed vLLM (0.32) posing as 0.35 matches the
    0.34 entry's sleep interface nowhere, so the first mismatch is named."""
    with pytest.raises(
        ConfigError, match=_RANGES + r"0\.35\.0 \(first mismatch against the 0\.34 entry: "
    ) as e:
        compat.accept((0, 35, 0))
    assert "\n" not in str(e.value)


def test_a_moved_symbol_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.core.block_pool as block_pool

    monkeypatch.delattr(block_pool.BlockPool, "touch")
    with pytest.raises(
        ConfigError, match=r"vLLM 0\.32\.0 does not have what the 0\.32 support expects: "
    ) as e:
        compat.accept((0, 32, 0))
    assert "BlockPool.touch: missing" in str(e.value) and "\n" not in str(e.value)


def test_engine_verified_release_is_accepted_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm_elastic_kv.compat"):
        assert compat.accept().label == "0.32"
    assert caplog.records == []


def test_installed_vllm_has_every_target() -> None:
    entry = compat.support_for(compat.installed_version())
    assert compat.check_installed(entry) == []
    module, _, func = entry.get_kv_cache_configs.partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    assert compat.mismatches(entry) == []


def test_check_installed_reports_a_moved_target() -> None:
    moved = compat.VersionSupport(
        (0, 0),
        (99, 0),
        "one_buffer",
        "",
        (
            compat.Target("vllm.v1.core.block_pool", "BlockPool.get_new_blockz"),
            compat.Target("vllm.v1.core.block_pool", "BlockPool.touch", params=("self", "blockz")),
            compat.Target("vllm.no_such_module", "X", kind="class"),
        ),
    )
    problems = compat.check_installed(moved)
    assert len(problems) == 3
    assert "get_new_blockz: missing" in problems[0]
    assert "expected to start with ('self', 'blockz')" in problems[1]


# --- every supported release, from its source ------------------------------------------------------
_RELEASES = [f"{e.lo[0]}.{e.lo[1]}.0" for e in compat.SUPPORT]


@pytest.fixture(scope="module", params=_RELEASES)
def release(request: pytest.FixtureRequest) -> tuple[compat.VersionSupport, Source]:
    try:
        src = open_source("vllm", request.param)
    except SourceUnavailable as exc:
        pytest.skip(
            f"vLLM {request.param} wheel unavailable offline, its source cannot be checked ({exc}); by hand: "
            f"python ci/compat_check.py {request.param}"
        )
    return compat.support_for(compat.parse_version(request.param)), src


def test_release_has_every_target_and_member(release: tuple[compat.VersionSupport, Source]) -> None:
    """``ci/compat_check.py`` on the release: its entry matches every target and member."""
    entry, src = release
    checked, rows = check_release(src)
    assert checked is entry
    assert [f"{r.symbol}: {r.release.text}" for r in rows if r.problem] == []


# Behaviour the plugin depends on beyond names: (module, function, calls it must make in this order).
_BEHAVIOUR = {
    "common": [
        # Plugins load before EngineArgs.add_cli_args builds the arguments (the --kv-cache-backend route).
        ("vllm.engine.arg_utils", "AsyncEngineArgs.add_cli_args", ("load_general_plugins", "add_cli_args")),
        # The KV cache is allocated inside the worker's memory-pool context for tag "kv_cache".
        ("vllm.v1.worker.gpu_worker", "Worker.initialize_from_config", ("_maybe_get_memory_pool_context",)),
        # The coordinator builds the block pool, the scheduler the KV cache manager, by these names.
        ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.__init__", ("BlockPool",)),
        ("vllm.v1.core.sched.scheduler", "Scheduler.__init__", ("KVCacheManager",)),
        # The elastic pool hands blocks out through vLLM's queue and takes back what vLLM prepends.
        ("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", ("popleft_n",)),
        ("vllm.v1.core.block_pool", "BlockPool.free_blocks", ("prepend_n",)),
        # allocate_slots checks the free blocks before it allocates (admission relies on the order).
        (
            "vllm.v1.core.kv_cache_manager",
            "KVCacheManager.allocate_slots",
            ("get_num_free_blocks", "allocate_new_blocks"),
        ),
        # Sleep clears the prefix cache through the scheduler (engine core, pause with clear_cache).
    ],
    "per_tensor": [
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._allocate_kv_cache_tensors", ("zeros",)),
        ("vllm.v1.worker.gpu.attn_utils", "_allocate_kv_cache", ("zeros",)),
    ],
    "one_buffer": [
        ("vllm.v1.worker.utils", "allocate_kv_cache", ("create_kv_cache_views",)),
    ],
}


def _allocates_with_zeros(src: Source) -> bool:
    """``allocate_kv_cache`` (without an ``allocate`` hook) makes its backing buffer with ``torch.zeros``,
    itself or in a function of its module that it calls."""
    node = lookup(src, "vllm.v1.worker.utils", "allocate_kv_cache")
    assert node is not None
    if calls_in_order(node, ("zeros", "create_kv_cache_views")):
        return True
    called = {getattr(c.func, "id", "") for c in ast.walk(node) if isinstance(c, ast.Call)}
    helpers = [lookup(src, "vllm.v1.worker.utils", name) for name in sorted(called)]
    return any(h is not None and calls_in_order(h, ("zeros",)) for h in helpers)


def _kv_cache_tag(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and getattr(n.func, "attr", "") == "_maybe_get_memory_pool_context"
        and any(isinstance(k.value, ast.Constant) and k.value.value == "kv_cache" for k in n.keywords)
        for n in ast.walk(node)
    )


def test_release_behaves_as_the_plugin_expects(release: tuple[compat.VersionSupport, Source]) -> None:
    entry, src = release
    for module, qualname, calls in _BEHAVIOUR["common"] + _BEHAVIOUR[entry.kv_allocation]:
        node = lookup(src, module, qualname)
        assert node is not None, f"{module}.{qualname} missing"
        assert calls_in_order(node, calls), f"{module}.{qualname} no longer calls {calls} in order"
    if entry.kv_allocation == "one_buffer":
        assert _allocates_with_zeros(src), "allocate_kv_cache no longer allocates with torch.zeros"
    init = lookup(src, "vllm.v1.worker.gpu_worker", "Worker.initialize_from_config")
    assert init is not None and _kv_cache_tag(init), "KV allocation is no longer inside the 'kv_cache' pool"


def test_installed_behaves_as_the_plugin_expects() -> None:
    """The same behaviour checks on the installed vLLM's own source files."""
    entry = compat.support_for(compat.installed_version())
    for module, qualname, calls in _BEHAVIOUR["common"] + _BEHAVIOUR[entry.kv_allocation]:
        obj = compat.resolve(compat.Target(module, qualname))
        func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        func = inspect.unwrap(func)
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        assert calls_in_order(tree, calls), f"{module}.{qualname} no longer calls {calls} in order"
    if entry.kv_allocation == "one_buffer":
        assert _allocates_with_zeros(open_source("vllm", "installed")), (
            "allocate_kv_cache no longer uses torch.zeros"
        )
