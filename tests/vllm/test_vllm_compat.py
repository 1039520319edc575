"""The compat table against the installed vLLM (signatures) and against the 0.26 wheel (source).

If vLLM moves or renames anything the plugin relies on, one of these fails and names the target.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest
from elastic_kv.errors import ConfigError
from vllm_elastic_kv import compat
from vllm_wheels import WheelSource, WheelUnavailable, calls_in_order, check_target, lookup, wheel

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
    ],
)
def test_version_table(version: compat.Version, allocation: str, configs: str) -> None:
    entry = compat.support_for(version)
    assert entry.kv_allocation == allocation
    assert entry.get_kv_cache_configs == configs


@pytest.mark.parametrize(
    "version", [(0, 25, 2), (0, 27, 0), (0, 29, 0), (0, 31, 1), (0, 33, 0), (0, 34, 0), (1, 0, 0)]
)
def test_unsupported_version_is_a_clear_config_error(version: compat.Version) -> None:
    """Only the releases an engine ran on are accepted, also between them."""
    with pytest.raises(ConfigError, match=r"supports vLLM 0\.26, 0\.32; this is vLLM "):
        compat.support_for(version)


def test_installed_vllm_has_every_target() -> None:
    entry = compat.support_for(compat.installed_version())
    assert compat.check_installed(entry) == []
    module, _, func = entry.get_kv_cache_configs.partition(":")
    assert callable(getattr(importlib.import_module(module), func))


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


# --- other releases, from their wheels -------------------------------------------------------------
@pytest.fixture(scope="module", params=["0.26.0"])
def release(request: pytest.FixtureRequest) -> tuple[compat.VersionSupport, WheelSource]:
    try:
        path = wheel(request.param)
    except WheelUnavailable as exc:
        pytest.skip(f"vLLM {request.param} wheel unavailable, its source cannot be checked: {exc}")
    return compat.support_for(compat.parse_version(request.param)), WheelSource(path)


def test_release_has_every_target(release: tuple[compat.VersionSupport, WheelSource]) -> None:
    entry, src = release
    problems = [p for t in entry.targets if (p := check_target(src, t)) is not None]
    assert problems == []
    module, _, func = entry.get_kv_cache_configs.partition(":")
    assert lookup(src, module, func) is not None, f"{module}:{func} missing"


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
        ("vllm.v1.worker.utils", "allocate_kv_cache", ("zeros", "create_kv_cache_views")),
    ],
}


def _kv_cache_tag(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and getattr(n.func, "attr", "") == "_maybe_get_memory_pool_context"
        and any(isinstance(k.value, ast.Constant) and k.value.value == "kv_cache" for k in n.keywords)
        for n in ast.walk(node)
    )


def test_release_behaves_as_the_plugin_expects(release: tuple[compat.VersionSupport, WheelSource]) -> None:
    entry, src = release
    for module, qualname, calls in _BEHAVIOUR["common"] + _BEHAVIOUR[entry.kv_allocation]:
        node = lookup(src, module, qualname)
        assert node is not None, f"{module}.{qualname} missing"
        assert calls_in_order(node, calls), f"{module}.{qualname} no longer calls {calls} in order"
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
