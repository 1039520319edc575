"""The multi-model benchmark's set-up arithmetic and the sleep set-up's config, without engines."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
from elastic_kv.sizes import Percent

from benchmarks.multimodel.engines import LLAMA_8B, ModelShape
from benchmarks.multimodel.setups import Plan, SleepSetup, StaticSetup, serve_available

GiB = 2**30
# Llama-3-8B's shape with a 32,000-token vocabulary, bf16
SHAPE_8B = ModelShape(
    vocab_size=LLAMA_8B["vocab_size"],
    layers=32,
    kv_heads=8,
    head_dim=128,
    hidden=4096,
    intermediate=14336,
    dtype_bytes=2,
)
TINY = ModelShape(
    vocab_size=1024, layers=2, kv_heads=2, head_dim=32, hidden=128, intermediate=256, dtype_bytes=4
)


def _plan(device: str, models: int, tmp_path: Path, **kw: object) -> Plan:
    fields: dict[str, object] = {
        "device": device,
        "model_dir": tmp_path,
        "shape": SHAPE_8B if device == "cuda" else TINY,
        "names": [f"m{i}" for i in range(models)],
        "engine_args": ["--dtype", "bfloat16" if device == "cuda" else "float32"],
        "max_model_len": 4608 if device == "cuda" else 1024,
        "kv_total": None if device == "cuda" else 12 << 20,
        "gpu_total": 140 * GiB if device == "cuda" else 0,
        "gpu_share": 0.9,
        "overhead": 3 * GiB if device == "cuda" else 0,
        "awake": max(1, models - 1),
        "idle_sleep_s": 10.0,
        "start_parallel": 1,
        "start_timeout_s": 600.0,
        "logs": tmp_path / "logs",
    }
    fields.update(kw)
    return Plan(**fields)  # type: ignore[arg-type]


def test_model_shape_arithmetic() -> None:
    assert SHAPE_8B.kv_bytes_per_token == 128 << 10  # 2 x 32 layers x 8 heads x 128 x 2 bytes
    assert SHAPE_8B.weights_bytes == pytest.approx(7.24e9 * 2, rel=0.01)
    assert TINY.kv_bytes_per_token == 1024


@pytest.mark.parametrize(("models", "fit"), [(3, 3), (6, 6), (8, 7)])
def test_static_shares_on_cuda_hold_as_many_models_as_fit(tmp_path: Path, models: int, fit: int) -> None:
    setup = StaticSetup(_plan("cuda", models, tmp_path))
    got, args = setup.shares()
    assert got == fit
    assert args == ["--gpu-memory-utilization", f"{0.9 / fit:.4f}"]
    assert ("do not fit" in setup.describe) == (fit < models)


def test_static_shares_on_cpu_split_the_kv_total(tmp_path: Path) -> None:
    assert StaticSetup(_plan("cpu", 3, tmp_path)).shares() == (3, ["--kv-cache-memory-bytes", str(4 << 20)])
    # 1.5 MiB holds one engine of max_model_len 1024 (1 KiB a token)
    assert StaticSetup(_plan("cpu", 2, tmp_path, kv_total=1536 << 10)).shares() == (
        1,
        ["--kv-cache-memory-bytes", str(1536 << 10)],
    )


@pytest.mark.skipif(not serve_available(), reason="elastic-kv serve is not installed")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sleep_config_is_a_valid_serve_config(tmp_path: Path, device: str) -> None:
    from elastic_kv_serve.config import parse_config

    extra: dict[str, object] = (
        {"host_budget": "40%", "preload": True, "start_parallel": 4, "host_arena_dir": tmp_path,
         "serve_options": {"kv_share_min_weights": 0.5}}
        if device == "cuda"
        else {}
    )  # fmt: skip
    plan = _plan(device, 6, tmp_path, **extra)
    setup = SleepSetup(plan, tmp_path / "models.toml")
    try:
        text, budget = setup.config(port=8123)
    finally:
        setup.stop()
    config = parse_config(tomllib.loads(text), "models.toml")
    assert config.server.port == 8123 and config.server.budget == budget
    assert config.server.registry_dir == setup.registry and config.server.idle_sleep_s == 10.0
    assert [m.name for m in config.models] == plan.names
    assert {m.priority for m in config.models} == {0}  # one priority: the least recently used sleeps first
    if device == "cuda":
        srv = config.server
        assert (srv.preload, srv.start_parallel, srv.host_arena_dir) == (True, 4, tmp_path)
        assert srv.host_budget == Percent(40.0) and srv.kv_share_min_weights == 0.5  # --serve-option
    else:  # the server's defaults
        assert (config.server.preload, config.server.start_parallel) == (False, 1)
    weights = config.models[0].weights_bytes
    assert weights is not None
    if device == "cuda":
        assert budget == int(0.9 * 140 * GiB)
        assert weights == SHAPE_8B.weights_bytes + 3 * GiB
        assert budget // weights == 7  # seven 8B engines fit awake: with eight models one sleeps
        args = config.models[0].args
        assert args[args.index("--kv-cache-memory-bytes") + 1] == str(budget - weights)
    else:
        # at most `awake` (5) models fit awake, and then their KV shares the KV total
        assert budget // weights == 5 and budget - 5 * weights == 12 << 20
        assert config.models[0].env["ELASTIC_KV_PAGE_SIZE"] == "64K"
