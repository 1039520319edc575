"""The SGLang support rule (``sglang_elastic_kv.compat.select``): an engine-verified release starts
silently, a source-verified one with one warning line, and any other release is refused in one line naming
the first symbol that does not match."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from elastic_kv.errors import ConfigError
from sglang_elastic_kv import compat
from sglang_elastic_kv.compat import support, versions

pytestmark = pytest.mark.sglang


# --- the table -----------------------------------------------------------------------------------
def test_each_version_is_engine_or_source_verified() -> None:
    assert {v: row.verified for row in compat.SEAMS for v in row.versions} == {"0.5.23": "engine"}


def test_every_hook_target_declares_the_parameters_its_hook_reads() -> None:
    targets = {f.name for f in dataclasses.fields(compat.Seams)} - {"versions", "verified"}
    assert set(compat.HOOK_PARAMS) == targets


@pytest.mark.parametrize(
    ("version", "against"),
    [("0.5.23", "0.5.23"), ("0.5.23.post1", "0.5.23"), ("0.5.24", "0.5.23"), ("0.5.9", "0.5.23")],
)
def test_a_release_is_checked_against_its_row_or_the_newest_below(version: str, against: str) -> None:
    assert compat.row_for(version).label == against


# --- the rule at start-up ----------------------------------------------------------------------------
def test_an_engine_verified_release_is_accepted_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sglang_elastic_kv.compat"):
        assert compat.select("0.5.23") is compat.SEAMS[0]
    assert caplog.records == []


def test_a_source_verified_release_starts_with_one_warning_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The installed 0.5.23 posing as a source-verified 0.5.24 (a row with 0.5.23's targets)."""
    source = dataclasses.replace(compat.SEAMS[0], versions=("0.5.24",), verified="source")
    monkeypatch.setattr(versions, "SEAMS", (*compat.SEAMS, source))
    support._warn_source_verified.cache_clear()
    with caplog.at_level(logging.WARNING, logger="sglang_elastic_kv.compat"):
        assert compat.select("0.5.24") is source
        assert compat.select("0.5.24") is source
    assert [r.getMessage() for r in caplog.records] == [
        "sglang-elastic-kv: sglang 0.5.24 is source-verified: every SGLang symbol the plugin relies on "
        "matches the 0.5.24 release's source, but no engine test has run on it (engine-verified: 0.5.23)"
    ]


def test_a_release_without_a_row_is_refused_naming_the_first_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang.srt.platforms.interface import SRTPlatform

    monkeypatch.delattr(SRTPlatform, "get_kv_pool_cls")
    with pytest.raises(ConfigError) as info:
        compat.select("0.5.24")
    assert str(info.value).startswith(
        "--kv-cache-backend=elastic does not support sglang 0.5.24: supported engine-verified 0.5.23 (first "
        "mismatch against 0.5.23: sglang.srt.platforms.interface.SRTPlatform.get_kv_pool_cls: missing"
    )
    assert "\n" not in str(info.value)


def test_a_supported_release_with_a_re_signed_hook_target_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    monkeypatch.setattr(SchedulerWeightUpdaterManager, "release_memory_occupation", lambda self, req: None)
    with pytest.raises(ConfigError) as info:
        compat.select("0.5.23")
    assert "\n" not in str(info.value)
    assert (
        "sglang 0.5.23 does not have what the plugin relies on: sglang.srt.managers.scheduler_components."
        "weight_updater.SchedulerWeightUpdaterManager.release_memory_occupation: parameters ('self', 'req'), "
        "expected to start with ('self', 'recv_req')"
    ) in str(info.value)
