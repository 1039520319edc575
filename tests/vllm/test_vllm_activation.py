"""Activation: the backend choice (additional_config, flag, environment), start-up refusals, patches.

No engine is started: ``EngineArgs.create_engine_config`` on the tiny model is all vLLM needs to build the
configuration the engine would run with.
"""

from __future__ import annotations

from typing import Any

import pytest
from elastic_kv.errors import ConfigError
from vllm_elastic_kv import compat, register
from vllm_elastic_kv.config import BACKEND_ENV, Backend, PluginConfig
from vllm_elastic_kv.frontend import activation, cli
from vllm_engines import engine_args

from tests.support.models import tiny_model

pytestmark = pytest.mark.vllm


# --- PluginConfig ----------------------------------------------------------------------------------
def test_backend_precedence_additional_config_then_environment_then_native() -> None:
    env = {BACKEND_ENV: "elastic"}
    assert PluginConfig.resolve({}, {}).backend is Backend.NATIVE
    assert PluginConfig.resolve({}, {}).source == "default"
    from_env = PluginConfig.resolve(None, env)
    assert (from_env.backend, from_env.source) == (Backend.ELASTIC, "environment")
    explicit = PluginConfig.resolve({"kv_cache_backend": "native"}, env)
    assert (explicit.backend, explicit.source) == (Backend.NATIVE, "additional_config")
    assert PluginConfig.resolve({"kv_cache_backend": " Elastic "}, {}).enabled


@pytest.mark.parametrize(
    ("additional", "env", "match"),
    [
        ({"kv_cache_backend": "elastc"}, {}, r"additional_config\['kv_cache_backend'\]='elastc'"),
        ({}, {BACKEND_ENV: "on"}, r"ELASTIC_KV_BACKEND='on'"),
        ({"elastic_kv": {"page_sise": "2M"}}, {}, r"unknown option\(s\) \['page_sise'\]"),
        ({"elastic_kv": {"limit_bytes": "lots"}}, {}, r"limit_bytes"),
        ({"elastic_kv": "2M"}, {}, r"must be a dict"),
        ({"elastic_kv": {"instance": "../x"}}, {}, r"malformed"),
        ({}, {"ELASTIC_KV_PAGE_SIZE": "3"}, r"ELASTIC_KV_PAGE_SIZE"),
    ],
)
def test_bad_settings_are_config_errors(additional: dict[str, Any], env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PluginConfig.resolve(additional, env)


def test_pool_options_come_from_environment_and_additional_config() -> None:
    cfg = PluginConfig.resolve(
        {"kv_cache_backend": "elastic", "elastic_kv": {"limit_bytes": "1G", "instance": "abc"}},
        {"ELASTIC_KV_PAGE_SIZE": "64K", "ELASTIC_KV_LIMIT": "2G", BACKEND_ENV: "native"},
    )
    assert cfg.elastic.page_size == 64 << 10
    assert cfg.elastic.limit_bytes == 1 << 30  # additional_config wins over the environment
    assert cfg.instance == "abc"


# --- the flag ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parser() -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def _engine_args(parser: Any, *argv: str) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", str(tiny_model()), *argv]))


def test_flag_is_in_help(parser: Any) -> None:
    text = parser.format_help()
    assert cli.GROUP_TITLE in text
    assert any(cli.FLAG in a.option_strings for a in parser._actions)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ((), {}),
        (("--kv-cache-backend", "elastic"), {"kv_cache_backend": "elastic"}),
        (("--kv-cache-backend=native",), {"kv_cache_backend": "native"}),
        # The dotted form is re-added by vLLM's parser after every other argument: both must survive.
        (
            ("--kv-cache-backend", "elastic", "--additional-config.foo", "1"),
            {"kv_cache_backend": "elastic", "foo": 1},
        ),
        (("--additional-config.kv_cache_backend", "elastic"), {"kv_cache_backend": "elastic"}),
        (
            ("--kv-cache-backend", "elastic", "--additional-config", '{"kv_cache_backend": "elastic"}'),
            {"kv_cache_backend": "elastic"},
        ),
    ],
)
def test_flag_lands_in_additional_config(parser: Any, argv: tuple[str, ...], expected: dict) -> None:
    assert _engine_args(parser, *argv).additional_config == expected


def test_conflicting_flag_and_additional_config(parser: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """On the command line a bad setting ends the command with one line and status 2, before any engine."""
    with pytest.raises(SystemExit) as exited:
        _engine_args(
            parser, "--kv-cache-backend", "elastic", "--additional-config.kv_cache_backend", "native"
        )
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("vllm-elastic-kv: ") and "conflicts" in line


def test_flag_rejects_unknown_backend(parser: Any) -> None:
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-backend", "paged"])


# --- create_engine_config ----------------------------------------------------------------------------
def _config(monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    return engine_args(**kwargs).create_engine_config()


def test_native_config_is_what_vllm_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.engine.arg_utils import EngineArgs

    ours = _config(monkeypatch)
    vllms = EngineArgs.create_engine_config.__wrapped__(engine_args())  # vLLM's own, under our wrapper
    assert ours.additional_config == vllms.additional_config == {}
    assert ours.scheduler_config.scheduler_cls == vllms.scheduler_config.scheduler_cls
    assert ours.parallel_config.worker_cls == vllms.parallel_config.worker_cls
    assert ours.compute_hash() == vllms.compute_hash()


@pytest.mark.parametrize("how", ["additional_config", "environment"])
def test_elastic_config_uses_official_hooks(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if how == "environment":
        cfg = _config(monkeypatch, env={BACKEND_ENV: "elastic"})
    else:
        cfg = _config(monkeypatch, additional_config={"kv_cache_backend": "elastic"})
    assert (
        cfg.scheduler_config.scheduler_cls
        == activation.SCHEDULERS[bool(cfg.scheduler_config.async_scheduling)]
    )
    assert cfg.parallel_config.worker_cls == "vllm_elastic_kv.worker.cpu_worker.ElasticCPUWorker"
    # The decision travels inside the config: engine core and workers do not depend on the environment.
    resolved = PluginConfig.from_vllm_config(cfg, {})
    assert resolved.enabled and resolved.instance


def test_each_engine_gets_its_own_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _config(monkeypatch, additional_config={"kv_cache_backend": "elastic"})
    b = _config(monkeypatch, additional_config={"kv_cache_backend": "elastic"})
    assert PluginConfig.from_vllm_config(a, {}).instance != PluginConfig.from_vllm_config(b, {}).instance


def test_custom_scheduler_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"custom scheduler class \(--scheduler-cls my\.Sched\)"):
        _config(monkeypatch, additional_config={"kv_cache_backend": "elastic"}, scheduler_cls="my.Sched")


def test_unsupported_features_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(monkeypatch)
    assert activation.unsupported(cfg) == []
    cfg.parallel_config.pipeline_parallel_size = 2  # served: every stage is a rank of the pool
    assert activation.unsupported(cfg) == []
    cfg.parallel_config.data_parallel_size = 2
    cfg.parallel_config.distributed_executor_backend = "ray"
    cfg.parallel_config.worker_cls = "my.Worker"
    reasons = "; ".join(activation.unsupported(cfg))
    for phrase in ("data parallelism", "executor 'ray'", "worker class my.Worker"):
        assert phrase in reasons
    assert "pipeline" not in reasons


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_ngram_and_draft_model_speculative_decoding_are_served(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """N-gram drafts own no KV; a draft model's layers join the target's groups (engine proofs:
    test_vllm_family_ngram.py, test_vllm_family_draft_model.py)."""
    speculative: dict[str, Any] = {"method": method, "num_speculative_tokens": 2}
    speculative.update({"prompt_lookup_max": 3} if method == "ngram" else {"model": str(tiny_model())})
    cfg = _config(
        monkeypatch, additional_config={"kv_cache_backend": "elastic"}, speculative_config=speculative
    )
    assert cfg.parallel_config.worker_cls == "vllm_elastic_kv.worker.cpu_worker.ElasticCPUWorker"


def test_eagle_speculative_decoding_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGLE / MTP draft layers are not proven on an engine: refused by name before anything starts."""
    with pytest.raises(
        ConfigError,
        match=r"other than ngram or a draft model \(--speculative-config method 'eagle'\)",
    ):
        _config(
            monkeypatch,
            additional_config={"kv_cache_backend": "elastic"},
            speculative_config={"method": "eagle", "model": str(tiny_model()), "num_speculative_tokens": 2},
        )


# --- patches ------------------------------------------------------------------------------------------
def test_register_is_idempotent() -> None:
    register()
    register()
    markers = compat.patched_symbols()
    assert sorted(markers) == sorted(
        [
            "vllm.engine.arg_utils.EngineArgs.add_cli_args: cli-flag",
            "vllm.engine.arg_utils.EngineArgs.from_cli_args: cli-to-additional-config",
            "vllm.engine.arg_utils.EngineArgs.create_engine_config: activation",
        ]
    )
    for patch in (*cli.patches(), activation.patch()):
        assert compat.apply_patch(patch) is False


def test_patching_a_moved_target_fails_loudly() -> None:
    moved = compat.Patch(
        "x", compat.Target("vllm.engine.arg_utils", "EngineArgs.no_such_method"), lambda f: f
    )
    with pytest.raises(ConfigError, match="cannot patch"):
        compat.apply_patch(moved)


def test_scoped_attribute_restores_and_checks() -> None:
    import vllm.v1.core.kv_cache_coordinator as coordinator

    target = compat.target("vllm.v1.core.kv_cache_coordinator", "BlockPool")
    original = coordinator.BlockPool
    sentinel = object()
    with pytest.raises(RuntimeError), compat.scoped_attribute(target, sentinel):
        assert coordinator.BlockPool is sentinel
        raise RuntimeError
    assert coordinator.BlockPool is original
    with (
        pytest.raises(ConfigError),
        compat.scoped_attribute(compat.Target(coordinator.__name__, "Nope", kind="name"), 1),
    ):
        pass


# --- vLLM's extensible KV cache (0.34+) ---------------------------------------------------------------
def test_the_elastic_backend_turns_vllms_extensible_kv_cache_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """On 0.34 (CUDA) vLLM turns it on by default; the elastic backend backs the KV range instead."""
    cfg = _config(monkeypatch)
    object.__setattr__(cfg.cache_config, "enable_extensible_kv_cache", True)  # as 0.34 resolves it on CUDA
    activation.activate(cfg, PluginConfig.resolve({"kv_cache_backend": "elastic"}, {}))
    assert cfg.cache_config.enable_extensible_kv_cache is False


def test_an_explicit_extensible_kv_cache_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(monkeypatch)
    with pytest.raises(ConfigError, match=r"extensible KV cache \(--enable-extensible-kv-cache"):
        activation.activate(cfg, PluginConfig.resolve({"kv_cache_backend": "elastic"}, {}), True)
