"""One version for every package of ``packages/``: the repository's VERSION file, read by each build."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "elastic-kv-core": "elastic_kv",
    "vllm-elastic-kv": "vllm_elastic_kv",
    "sglang-elastic-kv": "sglang_elastic_kv",
    "elastic-kv-serve": "elastic_kv_serve",
}


def _version() -> str:
    return (REPO / "VERSION").read_text().strip()


def test_every_package_is_listed() -> None:
    assert sorted(p.name for p in (REPO / "packages").iterdir() if (p / "pyproject.toml").exists()) == sorted(
        PACKAGES
    )


def test_version_file_is_a_release_number() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", _version())


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_each_package_reads_the_one_version_file(dist: str) -> None:
    package = REPO / "packages" / dist
    assert (package / "VERSION").resolve() == (REPO / "VERSION").resolve()
    pyproject = (package / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M), "the version must come from VERSION"
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M), "a second place holding the version"


@pytest.mark.parametrize(("dist", "module"), sorted(PACKAGES.items()))
def test_installed_packages_carry_it(dist: str, module: str) -> None:
    assert version(dist) == _version()
    assert __import__(module).__version__ == _version()


def test_changelog_has_an_entry_for_it() -> None:
    assert re.search(rf"^## {re.escape(_version())}\b", (REPO / "CHANGELOG.md").read_text(), re.M)
