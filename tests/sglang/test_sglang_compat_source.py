"""The SGLang support rule (``sglang_elastic_kv.compat.select``) and its source check
(``ci/sglang_compat_check.py``): every supported release's source has every symbol the plugin relies on, a
renamed, moved or re-signed symbol is named, and a release that is neither engine- nor source-verified is
refused in one line naming the first symbol that does not match.

The release checks read each supported release's wheel (downloaded once into ``.cache/wheels``, about 40 MB;
skipped with the reason when it cannot be fetched); the changed releases are the installed SGLang's source
with one symbol changed. By hand: ``python ci/sglang_compat_check.py 0.5.23``.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import sys
from pathlib import Path

import pytest
from elastic_kv.errors import ConfigError
from sglang_elastic_kv import compat
from sglang_elastic_kv.compat import support, versions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ci"))
from compat_source import Source, SourceUnavailable, calls_in_order, lookup, open_source
from sglang_compat_check import check_release, main

pytestmark = pytest.mark.sglang

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"


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


# --- every supported release, from its source ------------------------------------------------------
_RELEASES = [v for row in compat.SEAMS for v in row.versions]


@pytest.fixture(scope="module", params=_RELEASES)
def release(request: pytest.FixtureRequest) -> Source:
    try:
        return open_source("sglang", request.param)
    except SourceUnavailable as exc:
        pytest.skip(
            f"SGLang {request.param} wheel unavailable offline, its source cannot be checked ({exc}); by "
            f"hand: python ci/sglang_compat_check.py {request.param}"
        )


def test_release_has_every_symbol(release: Source) -> None:
    """``ci/sglang_compat_check.py`` on the release: its row matches every hook target and member."""
    row, rows = check_release(release)
    assert row is compat.row_for(release.version)
    assert [f"{r.symbol}: {r.release.text}" for r in rows if r.problem] == []


def test_release_behaves_as_the_plugin_expects(release: Source) -> None:
    """Beyond names: the configurator asks the platform for the pool and paged allocator classes (the seams
    the plugin hooks on the base class), no in-tree platform answers itself, and the hybrid request pool is
    built by the module-level name the plugin points at its own class for the call."""
    configurator = lookup(release, _CONFIGURATOR, "KVCacheConfigurator")
    assert configurator is not None and calls_in_order(configurator, ("get_kv_pool_cls",))
    builder = lookup(release, _CONFIGURATOR, "KVCacheConfigurator._build_token_to_kv_pool_allocator")
    assert builder is not None and calls_in_order(builder, ("get_paged_allocator_cls",))
    hybrid = lookup(release, _CONFIGURATOR, "KVCacheConfigurator._build_hybrid_req_pool")
    assert hybrid is not None and calls_in_order(hybrid, ("HybridReqToTokenPool",))
    for module in ("sglang.srt.platforms.cpu", "sglang.srt.platforms.cuda", "sglang.srt.platforms.rocm"):
        tree = release.module(module)
        assert tree is not None, module
        for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
            for seam in ("get_kv_pool_cls", "get_paged_allocator_cls"):
                assert lookup(release, module, f"{cls.name}.{seam}") is None, f"{module}.{cls.name}.{seam}"


# --- a changed release -----------------------------------------------------------------------------
def _changed_copy(root: Path, changes: dict[str, tuple[str, str]]) -> Path:
    """``root`` made a folder holding the installed SGLang's ``sglang/**.py`` (links to the installed files),
    with ``changes`` (file under ``sglang/`` -> (text, its replacement); an empty text adds to the file,
    which may be new) made in copies of those files."""
    installed = open_source("sglang", "installed").path
    for path in (installed / "sglang").rglob("*.py"):
        link = root / path.relative_to(installed)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    for name, (old, new) in changes.items():
        file = root / "sglang" / name
        text = file.read_text() if file.exists() else ""
        assert old in text, f"{name} no longer has {old!r}"
        file.unlink(missing_ok=True)
        file.write_text(text.replace(old, new, 1) if old else text + new)
    return root


_INTERFACE = "srt/platforms/interface.py"
_UPDATER = "srt/managers/scheduler_components/weight_updater.py"


@pytest.mark.parametrize(
    ("changes", "symbol", "text"),
    [
        pytest.param(
            {_INTERFACE: ("def get_kv_pool_cls(", "def get_kv_pool_class(")},
            "sglang.srt.platforms.interface.SRTPlatform.get_kv_pool_cls",
            "missing",
            id="renamed",
        ),
        pytest.param(
            {
                "srt/mem_cache/common.py": ("def release_kv_cache(", "def _release_kv_cache_gone("),
                "srt/mem_cache/release.py": ("", "def release_kv_cache(req, tree_cache):\n    pass\n"),
            },
            "sglang.srt.mem_cache.common.release_kv_cache",
            "missing; defined in sglang.srt.mem_cache.release",
            id="moved",
        ),
        pytest.param(
            {
                _UPDATER: (
                    "def release_memory_occupation(self, recv_req",
                    "def release_memory_occupation(self, req",
                )
            },
            "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
            ".release_memory_occupation",
            "(self, req)",
            id="re-signed",
        ),
    ],
)
def test_a_changed_symbol_is_named(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    changes: dict[str, tuple[str, str]],
    symbol: str,
    text: str,
) -> None:
    """The check on a release with one symbol changed: exit status 1, its row in the table, and the summary
    line names it as the first symbol that does not match."""
    assert main([str(_changed_copy(tmp_path, changes)), "--against", "none"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"| {symbol} ") and f"NO: {text} " in line for line in out), out
    assert out[-1].endswith(f"the 0.5.23 row does not match: first {symbol} ({text})"), out[-1]


def test_the_installed_release_matches_and_a_bad_argument_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["installed", "--against", "none"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("the 0.5.23 row matches")
    assert main(["no-such-release"]) == 2


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
    assert str(info.value) == (
        "--kv-cache-backend=elastic does not support sglang 0.5.24: supported engine-verified 0.5.23 (first "
        "mismatch against 0.5.23: sglang.srt.platforms.interface.SRTPlatform.get_kv_pool_cls: missing); "
        "install a supported version or use --kv-cache-backend=native"
    )


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
