"""Sleep mode with the elastic KV cache, the parts that run without a GPU (the sleep itself: the ``gpu``
module ``test_vllm_sleep_gpu.py``).

* The worker's ``sleep`` answers vLLM's device-wide free-memory check, and only that check, with a log line:
  the check's message is pinned to the installed vLLM's source, so a reworded check fails here instead of
  failing sleeps beside neighbours again.
* Activation selects the ``elastic`` sleep-mode backend exactly when sleep mode is on and a host arena is
  configured, and ``register`` makes vLLM's factory resolve that name to the plugin's class.
* A demotion (level 1 in the arena to level 2) keeps what vLLM's level-2 sleep keeps, the model's buffers,
  read from the allocations' host copies: the reading is checked on tensors laid out like a model's inside
  allocations, and what vLLM keeps is pinned to the installed source. The demotion itself runs on a GPU
  (``test_vllm_sleep_gpu.py``).
"""

from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_elastic_kv import SLEEP_BACKEND, register
from vllm_elastic_kv.config import PluginConfig
from vllm_elastic_kv.frontend import activation
from vllm_elastic_kv.worker import worker
from vllm_engines import engine_args

pytestmark = pytest.mark.vllm


def test_the_check_the_worker_answers_is_the_one_vllm_ends_sleep_with() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    source = inspect.getsource(Worker.sleep)
    assert f'"{worker._SLEEP_FREE_MEMORY_CHECK}.' in source


class _Base:
    """Stands in for vLLM's GPU worker, whose ``sleep`` cannot run without CUDA: it fails the way vLLM's
    closing check does (after the sleep completed), or another way."""

    def __init__(self, failure: str | None) -> None:
        self.failure = failure
        self.slept: list[int] = []

    def sleep(self, level: int = 1) -> None:
        self.slept.append(level)
        if self.failure is not None:
            raise AssertionError(self.failure)


class _Worker(worker.ElasticWorkerMixin, _Base):
    pass


def test_the_neighbour_check_is_a_log_line_other_failures_stay(caplog: pytest.LogCaptureFixture) -> None:
    w = _Worker("Memory usage increased after sleeping.")
    with caplog.at_level(logging.INFO, logger="vllm_elastic_kv.worker.worker"):
        w.sleep(2)
    assert w.slept == [2] and "other engines on this GPU allocated" in caplog.text
    with pytest.raises(AssertionError, match="something else"):
        _Worker("something else").sleep(1)
    ok = _Worker(None)
    ok.sleep(1)
    assert ok.slept == [1]


def _config(monkeypatch: pytest.MonkeyPatch, arena: Path | None, sleep_mode: bool) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    # vLLM's own config, not yet activated (the plugin's hook unwrapped, where another test installed it)
    config = inspect.unwrap(EngineArgs.create_engine_config)(engine_args())
    # vLLM's CPU platform refuses --enable-sleep-mode when the config is built; the flag is what activation
    # reads, so it is set on the built config.
    config.model_config.enable_sleep_mode = sleep_mode
    env = {"ELASTIC_KV_BACKEND": "elastic"}
    if arena is not None:
        env["ELASTIC_KV_HOST_ARENA"] = str(arena)
    activation.activate(config, PluginConfig.from_vllm_config(config, env))
    return config


@pytest.mark.parametrize(
    ("arena", "sleep_mode", "backend"),
    [(True, True, SLEEP_BACKEND), (False, True, "cumem"), (True, False, "cumem")],
)
def test_activation_selects_the_elastic_backend_with_sleep_mode_and_an_arena(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, arena: bool, sleep_mode: bool, backend: str
) -> None:
    config = _config(monkeypatch, tmp_path / "host.arena" if arena else None, sleep_mode)
    assert config.model_config.sleep_mode_backend == backend


def test_register_makes_the_name_resolve_to_the_plugins_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    monkeypatch.setenv("ELASTIC_KV_HOST_ARENA", str(tmp_path / "host.arena"))
    register()
    register()  # idempotent
    cls = SleepModeBackendFactory.get_backend_class(SLEEP_BACKEND)
    assert (cls.__module__, cls.__name__) == ("vllm_elastic_kv.worker.sleep", "ElasticSleepBackend")


@pytest.mark.parametrize(
    ("suspend_by", "args", "kwargs", "level_one"),
    [
        ("level", (1,), {}, True),
        ("level", (2,), {}, False),
        ("level", (), {"level": 2}, False),
        ("level", (), {}, True),
        ("discardable", ((),), {}, True),  # 0.34: suspend(discardable), nothing to drop at level 1
        ("discardable", ({0x7F00},), {}, False),
        ("discardable", (), {"discardable": {1}}, False),
        ("discardable", (), {}, True),
    ],
)
def test_a_level_one_sleep_is_recognised_in_both_suspend_interfaces(
    suspend_by: str, args: tuple[Any, ...], kwargs: dict[str, Any], level_one: bool
) -> None:
    from vllm_elastic_kv.worker.sleep import ElasticSleepBackend

    backend = ElasticSleepBackend.__new__(ElasticSleepBackend)
    backend._suspend_by = suspend_by  # type: ignore[assignment]
    assert backend._level_one(args, kwargs) is level_one


def test_arena_extents_are_owned_by_the_pool_the_worker_names() -> None:
    # The worker names the owner from the configured pool name (additional_config or ELASTIC_KV_POOL_NAME);
    # without one, the backend's own default (this process) stays.
    from vllm_elastic_kv.worker import sleep

    backend = sleep.ElasticSleepBackend.__new__(sleep.ElasticSleepBackend)
    backend._default_owner = "vllm-123"
    try:
        assert backend._owner == "vllm-123"
        sleep.set_owner("serve.m0")
        assert backend._owner == "serve.m0"
    finally:
        sleep.set_owner(None)
    assert backend._owner == "vllm-123"


def test_host_copies_read_each_buffer_from_its_allocations_host_copy() -> None:
    from vllm_elastic_kv.worker.sleep import host_copies

    # Two "allocations" (1 KiB each) stand in for the device memory that sleeps; the buffers are tensors
    # inside them, as a model's are: one at an offset, one strided (a transposed view), one outside both.
    first, second = torch.zeros(1024, dtype=torch.uint8), torch.zeros(1024, dtype=torch.uint8)
    rope = first[64 : 64 + 4 * 24].view(torch.float32).view(4, 6)
    rope.copy_(torch.arange(24, dtype=torch.float32).view(4, 6))
    mask = second[256 : 256 + 2 * 30].view(torch.bfloat16).view(5, 6).t()
    mask.copy_(torch.linspace(-1, 1, 30).view(6, 5).to(torch.bfloat16))
    outside = torch.ones(3)
    want = {"rope": rope.clone(), "mask": mask.clone()}
    backups = {first.data_ptr(): first.clone(), second.data_ptr(): second.clone()}
    first.zero_()  # the device copy is gone once asleep
    second.zero_()

    got = host_copies([("rope", rope), ("mask", mask), ("outside", outside)], backups)

    assert sorted(got) == ["mask", "rope"]  # a tensor outside every allocation does not sleep
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].stride() == tensor.stride()
        assert torch.equal(got[name], tensor)
        assert got[name].untyped_storage().data_ptr() not in (first.data_ptr(), second.data_ptr())


def test_a_demotion_keeps_what_vllms_level_2_sleep_keeps() -> None:
    # vLLM's level-2 sleep saves the model's named buffers into _sleep_saved_buffers, and its wake-up
    # restores them from there: exactly what elastic_kv_demote fills.
    from vllm.v1.worker.gpu_worker import Worker

    sleep, wake = inspect.getsource(Worker.sleep), inspect.getsource(Worker.wake_up)
    assert re.search(r"self\._sleep_saved_buffers = \{\s*name: buffer\.cpu\(\)\.clone\(\)", sleep)
    assert "model.named_buffers()" in sleep
    assert "buffer.data.copy_(self._sleep_saved_buffers[name].data)" in wake


class _Plain:
    """A worker whose sleep-mode backend is vLLM's own."""

    _sleep_mode_backend = object()
    _sleep_saved_buffers: dict[str, torch.Tensor] = {}


class _PlainWorker(worker.ElasticWorkerMixin, _Plain):
    pass


def test_a_demotion_is_refused_without_the_elastic_backend() -> None:
    with pytest.raises(RuntimeError, match="not asleep through the elastic sleep-mode backend"):
        _PlainWorker().elastic_kv_demote()


def test_the_size_of_a_level_1_sleep_is_read_from_vllms_allocator_where_it_is_a_cumem_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What elastic_kv_pin_host reports to elastic-kv serve: the allocations under the offloaded tags that
    # are awake, from vLLM's CuMemAllocator (its records: a handle's second field is the size).
    from types import SimpleNamespace

    import vllm.device_allocator as allocators
    from vllm_elastic_kv import compat
    from vllm_elastic_kv.worker import sleep

    tag = "weights"
    assert tag in compat.support_for(compat.installed_version()).sleep_offload_tags

    def record(tag: str, size: int, asleep: bool = False) -> SimpleNamespace:
        return SimpleNamespace(tag=tag, is_asleep=asleep, handle=(0, size, 0, 0))

    cumem = SimpleNamespace(
        pointer_to_data={1: record(tag, 3 << 20), 2: record(tag, 5 << 20), 3: record("kv_cache", 64 << 20),
                         4: record(tag, 7 << 20, asleep=True)}
    )  # fmt: skip
    monkeypatch.setattr(allocators, "get_mem_allocator_instance", lambda: cumem)
    assert sleep.level_one_bytes() == 8 << 20
    monkeypatch.setattr(allocators, "get_mem_allocator_instance", lambda: SimpleNamespace())  # another kind
    assert sleep.level_one_bytes() == 0
    monkeypatch.undo()
    assert sleep.level_one_bytes() == 0  # this CPU platform has no sleep-mode allocator


# -- a sleep that keeps its requests keeps their state ------------------------------------------------
class _Allocator:
    """vLLM's ``CuMemAllocator`` as the backend reads it: records (a handle's second field is the size, a
    host copy in ``cpu_backup_tensor``) and the tags each ``sleep`` was asked to copy to the host."""

    def __init__(self, **records: Any) -> None:
        self.pointer_to_data = records
        self.slept: list[tuple[str, ...]] = []

    def sleep(self, offload_tags: tuple[str, ...] = ()) -> None:
        self.slept.append(tuple(offload_tags))


def _backend_on(monkeypatch: pytest.MonkeyPatch, version: tuple[int, int, int], park_kv: bool) -> Any:
    from vllm_elastic_kv import compat
    from vllm_elastic_kv.worker import sleep

    monkeypatch.setattr(compat, "installed_version", lambda: version)
    monkeypatch.setenv("ELASTIC_KV_PARK_KV", "1" if park_kv else "0")
    monkeypatch.delenv("ELASTIC_KV_HOST_ARENA", raising=False)
    return sleep.ElasticSleepBackend()


@pytest.mark.parametrize(
    ("version", "park_kv", "state"),
    [((0, 26, 0), True, ("kv_cache",)), ((0, 26, 0), False, ()), ((0, 32, 0), True, ())],
)
def test_only_a_sleep_that_keeps_requests_on_0_26_copies_the_kv_cache_pool_at_every_level(
    monkeypatch: pytest.MonkeyPatch, version: tuple[int, int, int], park_kv: bool, state: tuple[str, ...]
) -> None:
    # vLLM's own keep-mode sleep preempts its requests, so the state it builds with the KV cache may be
    # discarded; with park_kv the scheduler keeps them, and on 0.26 that state sits in the "kv_cache" pool.
    import vllm.device_allocator as allocators

    backend = _backend_on(monkeypatch, version, park_kv)
    allocator = _Allocator()
    monkeypatch.setattr(allocators, "get_mem_allocator_instance", lambda: allocator)
    backend.suspend(1)  # no arena: vLLM's host copies
    backend.suspend(2)
    if state:  # 0.26's own backend copies the weights at level 1, nothing at level 2
        assert allocator.slept == [("weights", *state), state]
    else:  # the installed vLLM's own backend, unchanged
        assert allocator.slept == [("weights", "runtime", "cudagraph"), ("runtime", "cudagraph")]
    assert backend.state() == "SUSPENDED"


def test_the_kv_cache_pools_state_is_in_the_runtime_pool_vllm_keeps_from_0_32() -> None:
    # Why the table gives 0.32 no state tags: the installed vLLM builds the KV cache's state (the input
    # batch, the attention backends' buffers) in its "runtime" pool, and its sleep keeps that pool.
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend
    from vllm.v1.worker.gpu_worker import Worker

    build = inspect.getsource(Worker.initialize_from_config)
    assert re.search(
        r'tag="runtime"\)\s*\)\s*with runtime_pool:\s*self\.model_runner\.initialize_kv_cache', build
    )
    assert 'offload_tags: tuple[str, ...] = ("runtime", "cudagraph")' in inspect.getsource(
        CuMemBackend.suspend
    )


def test_a_demotion_keeps_the_kept_requests_state_off_the_extent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    import vllm.device_allocator as allocators
    from elastic_kv.host import HostArena

    backend = _backend_on(monkeypatch, (0, 26, 0), park_kv=True)
    arena = HostArena.create(tmp_path / "host.arena", 1 << 20)
    try:
        extent = arena.take(4096, "m")
        assert extent is not None
        view = torch.frombuffer(bytearray(4096), dtype=torch.uint8)
        view[2048:] = 7
        weights = SimpleNamespace(tag="weights", cpu_backup_tensor=view[:2048])
        state = SimpleNamespace(tag="kv_cache", cpu_backup_tensor=view[2048:])
        monkeypatch.setattr(
            allocators, "get_mem_allocator_instance", lambda: _Allocator(**{"1": weights, "2": state})
        )
        backend._arena, backend._extent = SimpleNamespace(arena=arena), extent
        backend.demote([])
        view.zero_()  # the extent is someone else's now
        assert weights.cpu_backup_tensor is None  # reloaded at wake-up, as after a level-2 sleep
        assert torch.equal(state.cpu_backup_tensor, torch.full((2048,), 7, dtype=torch.uint8))
        assert arena.extents() == []
    finally:
        arena.close()
        arena.remove()


@pytest.mark.parametrize(
    ("version", "arena", "keeps"),
    [((0, 26, 0), True, True), ((0, 26, 0), False, False), ((0, 32, 0), False, True)],
)
def test_a_sleep_keeps_its_requests_running_only_where_their_state_survives_it(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, version: tuple[int, int, int], arena: bool, keeps: bool
) -> None:
    # On 0.26 the state survives only through the plugin's sleep-mode backend, which needs a host arena;
    # without one the requests are preempted (and computed again) as vLLM does, and the log says why.
    from vllm_elastic_kv import compat
    from vllm_elastic_kv.scheduler.scheduler import keeps_requests

    env = {"ELASTIC_KV_PARK_KV": "1", **({"ELASTIC_KV_HOST_ARENA": str(tmp_path / "a")} if arena else {})}
    plugin = PluginConfig.from_vllm_config(engine_args().create_engine_config(), env)
    with caplog.at_level(logging.WARNING, logger="vllm_elastic_kv.scheduler.scheduler"):
        assert keeps_requests(plugin, compat.support_for(version)) is keeps
    assert ("ELASTIC_KV_PARK_KV ignored" in caplog.text) is not keeps
    # 0.26's wake-up zeroes a quantized KV cache, the kept requests' blocks on the null block's page too
    assert keeps_requests(plugin, compat.support_for(version), "fp8_e4m3") is (
        keeps and version >= (0, 32, 0)
    )
    off = PluginConfig.from_vllm_config(engine_args().create_engine_config(), {"ELASTIC_KV_PARK_KV": "0"})
    assert not keeps_requests(off, compat.support_for(version))
