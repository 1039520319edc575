"""The member tables of ``vllm_elastic_kv.compat`` against the installed vLLM, and what a missing member does.

The signature table (``compat.versions``) is tested in ``test_vllm_compat.py``; this file covers the
attributes, fields and instance members (``compat.members``): all present in the installed vLLM, and a
missing one stops activation with one line naming it and the version.
"""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import vllm_elastic_kv
from elastic_kv.errors import ConfigError
from vllm_elastic_kv import compat
from vllm_elastic_kv.compat import members
from vllm_elastic_kv.config import BACKEND_ENV, PluginConfig
from vllm_elastic_kv.frontend import activation
from vllm_engines import engine_args

pytestmark = pytest.mark.vllm


def _support() -> compat.VersionSupport:
    return compat.support_for(compat.installed_version())


def _version_text() -> str:
    return ".".join(map(str, compat.installed_version()[:2]))


def _native_config(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    return engine_args().create_engine_config()


_OFF_CPU = """
import sys, torch
event, pin = torch.cuda.Event, torch.Tensor.pin_memory
from vllm.platforms import current_platform
current_platform.is_cpu = lambda: False  # as on a GPU
from vllm_elastic_kv import compat
assert compat.missing_members(compat.support_for(compat.installed_version())) == []
assert "vllm.v1.worker.cpu_worker" not in sys.modules, "the CPU worker was imported"
assert torch.cuda.Event is event and torch.Tensor.pin_memory is pin, "torch's device API was rebound"
"""


def test_the_member_check_off_the_cpu_leaves_torchs_device_api_alone() -> None:
    # Importing vLLM's CPU worker rebinds torch.cuda.Event, Tensor.pin_memory and more for the whole process
    # (and the engine processes forked from it): on a GPU that broke torch.compile's autotuning and vLLM's
    # pinned buffers. Off the CPU platform the member check must not import it.
    done = subprocess.run([sys.executable, "-c", _OFF_CPU], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_installed_vllm_has_every_member() -> None:
    assert compat.missing_members(_support()) == []


def test_every_allocation_style_has_its_members() -> None:
    assert set(compat.MEMBERS_BY_ALLOCATION) == {entry.kv_allocation for entry in compat.SUPPORT}


def test_probed_members_name_real_owners() -> None:
    """A probed member may be absent, but its owner (module or class) must exist: a typo in the table
    would otherwise document a dependency that is not there."""
    for dotted in compat.PROBED:
        owner, _, _ = dotted.rpartition(".")
        assert pkgutil.resolve_name(owner) is not None, dotted


def test_instances_vllm_builds_carry_the_listed_members() -> None:
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    compat.check_instance(pool, "vllm.v1.core.block_pool.BlockPool")
    compat.check_instance(pool.free_block_queue, "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue")
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1), None)
    compat.check_instance(request, "vllm.v1.request.Request")


def test_an_instance_without_a_listed_member_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        compat.check_instance(object(), "vllm.v1.core.kv_cache_manager.KVCacheManager")
    message = str(caught.value)
    assert "\n" not in message
    assert f"vLLM {_version_text()}" in message
    assert "KVCacheManager instances lack coordinator, block_pool" in message


def test_a_missing_member_stops_activation_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM whose ``KVCacheBlock`` lost ``reset_hash`` (the idle trim calls it) is refused before any
    engine process starts, naming the member and the version."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    config = _native_config(monkeypatch)
    monkeypatch.delattr(KVCacheBlock, "reset_hash")
    assert compat.missing_members(_support()) == ["vllm.v1.core.kv_cache_utils.KVCacheBlock.reset_hash"]
    plugin = PluginConfig.resolve({"kv_cache_backend": "elastic"}, {})
    with pytest.raises(ConfigError) as caught:
        activation.activate(config, plugin)
    message = str(caught.value)
    assert "\n" not in message
    assert f"vLLM {_version_text()}" in message
    assert "vllm.v1.core.kv_cache_utils.KVCacheBlock.reset_hash: missing" in message
    assert config.additional_config == {}  # refused before anything was changed


def test_a_class_that_takes_no_new_attribute_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(members, "ADDED_ATTRIBUTES", {"builtins.int": ("_elastic_kv_epoch",)})
    assert compat.missing_members(_support()) == ["builtins.int._elastic_kv_epoch (settable)"]


# Probes in the plugin's source that read something other than vLLM.
_NOT_VLLM = {"hip"}  # torch.version.hip: which data-plane backend a GPU gets


def test_every_probe_in_the_plugin_is_listed() -> None:
    """Each ``getattr(obj, "name", ...)`` / ``hasattr(obj, "name")`` in the plugin reads a member some vLLM
    release may lack: it must be in a table, so that a probe added without one fails here."""
    listed = {dotted.rpartition(".")[2] for dotted in compat.PROBED}
    tables = (
        compat.MEMBERS,
        compat.CPU_MEMBERS,
        compat.INSTANCE_MEMBERS,
        *compat.MEMBERS_BY_ALLOCATION.values(),
    )
    for table in tables:
        for names in table.values():
            listed.update(names)
    probe = re.compile(r"\b(?:getattr|hasattr)\([^,()]+(?:\([^()]*\))?, \"([A-Za-z_]+)\"")
    source = Path(vllm_elastic_kv.__file__).parent
    unlisted = {
        f"{path.name}: {name}"
        for path in source.rglob("*.py")
        if "compat" not in path.relative_to(source).parts
        for name in probe.findall(path.read_text())
        if name not in listed and name not in _NOT_VLLM
    }
    assert not unlisted, f"probes of vLLM members missing from vllm_elastic_kv.compat: {sorted(unlisted)}"
