"""ElasticConfig (the one place environment variables are read), ReservePolicy, PoolSnapshot round trips."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from elastic_kv import sizes
from elastic_kv.config import ElasticConfig, parse_size
from elastic_kv.errors import ConfigError
from elastic_kv.ledger.reserve import ReservePolicy
from elastic_kv.snapshot import SNAPSHOT_SCHEMA, PoolSnapshot, PoolState


def test_config_reads_sizes_with_the_operators_parser() -> None:
    """``elastic_kv.config.parse_size`` (what ``ELASTIC_KV_*`` sizes go through) is ``kvctl``'s parser; its
    cases are in ``tests/limits/test_layout_and_sizes.py``."""
    assert parse_size is sizes.parse_size


def test_from_env_reads_only_its_prefix() -> None:
    env = {
        "ELASTIC_KV_PAGE_SIZE": "4M",
        "ELASTIC_KV_RESERVE_MIN": "2",
        "ELASTIC_KV_RESERVE_MAX": "32",
        "ELASTIC_KV_DEFER_RELEASE": "true",
        "ELASTIC_KV_PREMAP": "0",
        "ELASTIC_KV_LIMIT": "8G",
        "ELASTIC_KV_MIN_FREE": "1G",
        "ELASTIC_KV_REGISTRY_DIR": "/tmp/ekv",
        "ELASTIC_KV_POOL_NAME": "llama-8b.kv",
        "HOME": "/root",
        "VLLM_PAGE_SIZE": "1",
    }
    cfg = ElasticConfig.from_env(env)
    assert cfg == ElasticConfig(
        page_size=4 << 20,
        reserve_min_pages=2,
        reserve_max_pages=32,
        defer_release=True,
        premap=False,
        limit_bytes=8 << 30,
        min_free_bytes=1 << 30,
        registry_dir=Path("/tmp/ekv"),
        pool_name="llama-8b.kv",
    )
    assert ElasticConfig.from_env({}) == ElasticConfig()
    assert ElasticConfig.from_env({"ELASTIC_KV_LIMIT": "1G"}, limit_bytes=5).limit_bytes == 5


def test_from_env_names_the_bad_variable() -> None:
    with pytest.raises(ConfigError, match="ELASTIC_KV_PAGE_SIZE='huge'"):
        ElasticConfig.from_env({"ELASTIC_KV_PAGE_SIZE": "huge"})
    with pytest.raises(ConfigError, match="ELASTIC_KV_DEFER_RELEASE"):
        ElasticConfig.from_env({"ELASTIC_KV_DEFER_RELEASE": "maybe"})
    with pytest.raises(ConfigError, match="RESERVE_MIN"):
        ElasticConfig.from_env({"ELASTIC_KV_RESERVE_MIN": "9", "ELASTIC_KV_RESERVE_MAX": "3"})
    with pytest.raises(TypeError):
        ElasticConfig.from_env({}, page_sz=1)


def test_unknown_variable_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="elastic_kv.config"):
        ElasticConfig.from_env({"ELASTIC_KV_PAGESIZE": "2M"})
    assert "ELASTIC_KV_PAGESIZE" in caplog.text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 1000},
        {"page_size": 0},
        {"max_page_slots": 0},
        {"reserve_min_pages": -1},
        {"reserve_window": 0},
        {"limit_bytes": -1},
        {"free_memory_ttl_s": float("nan")},
        {"publish_interval_s": -1.0},
        {"pool_name": "a/b"},
        {"pool_name": ""},
    ],
)
def test_invalid_config_is_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ElasticConfig(**kwargs)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    cfg = ElasticConfig()
    with pytest.raises(AttributeError):
        cfg.page_size = 1  # type: ignore[misc]


def test_reserve_policy_follows_recent_growth_within_bounds() -> None:
    policy = ReservePolicy(min_pages=1, max_pages=8, window=3)
    assert policy.target == 1
    policy.note_acquired(5)  # a burst raises the target at once
    assert policy.target == 5
    assert policy.end_interval() == 5
    policy.note_acquired(20)
    assert policy.target == 8  # capped
    assert policy.end_interval() == 8
    for expect in (8, 8, 1):  # the burst leaves the 3-step window
        assert policy.end_interval() == expect
    with pytest.raises(ValueError):
        ReservePolicy(3, 2, 1)


def test_reserve_policy_counts_expected_demand_like_pages_taken() -> None:
    policy = ReservePolicy(min_pages=1, max_pages=8, window=2)
    policy.note_expected(4)  # requests arrived: the target rises before any page is taken
    assert policy.target == 4
    policy.note_acquired(3)  # the step took 3 of them: the interval's demand is still 4, not 3 or 7
    assert policy.end_interval() == 4
    policy.note_expected(30)
    assert policy.target == 8  # capped
    for expect in (8, 8, 1):  # an expectation leaves the window like a burst
        assert policy.end_interval() == expect


def test_reserve_policy_light_target_follows_light_intervals_only() -> None:
    policy = ReservePolicy(min_pages=2, max_pages=8, window=3)
    policy.note_acquired(6)
    assert policy.end_interval() == 6  # a heavy step (prefill)
    assert policy.light_target == 2  # no light step in the window yet: the minimum
    policy.note_acquired(3)
    assert policy.end_interval(light=True) == 6  # the target still remembers the heavy step
    assert policy.light_target == 3
    policy.note_acquired(20)
    policy.end_interval(light=True)
    assert policy.light_target == 8  # capped like the target
    for _ in range(3):  # quiet light steps: both fall back to the minimum
        policy.end_interval(light=True)
    assert policy.light_target == policy.target == 2
    bare = ReservePolicy(min_pages=0, max_pages=8, window=3)
    assert bare.light_target == 0  # nothing taken lately: nothing to hold
    bare.note_acquired(5)
    bare.end_interval()
    assert bare.light_target == 1  # a page for the first light step that needs one


def test_snapshot_round_trip_and_schema() -> None:
    snap = PoolSnapshot(
        name="p", state=PoolState.SHRINKING, block_size_bytes=1, page_size=2, page_bytes=3, blocks_per_page=4,
        total_blocks=5, used_blocks=6, free_blocks=7, available_blocks=8, total_pages=9, mapped_pages=10,
        reserve_pages=11, pending_pages=12, inflight_pages=13, mapped_bytes=14, limit_bytes=15,
        reserve_hits=3, reserve_misses=1, epoch=18, timestamp=19.5,
    )  # fmt: skip
    data = snap.as_dict()
    assert (
        data["schema"] == SNAPSHOT_SCHEMA
        and data["state"] == "shrinking"
        and data["reserve_hit_rate"] == 0.75
    )
    assert PoolSnapshot.from_dict({**data, "added_later": 1}) == snap
    with pytest.raises(ValueError, match="schema"):
        PoolSnapshot.from_dict({**data, "schema": "other.v9"})
    del data["epoch"]
    with pytest.raises(ValueError, match="epoch"):
        PoolSnapshot.from_dict(data)
