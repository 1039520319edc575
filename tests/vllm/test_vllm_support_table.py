"""The vLLM package README's support table is the one the tests prove (:mod:`vllm_support`)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from vllm_elastic_kv import features
from vllm_elastic_kv.features import SPECS
from vllm_elastic_kv.frontend import activation
from vllm_families import FAMILIES
from vllm_support import FULL_ATTENTION, FULL_ATTENTION_CPU, README, REFUSED, REPO_ROOT, readme_table, render

pytestmark = pytest.mark.vllm


def test_the_readme_table_is_the_generated_one() -> None:
    assert readme_table(README.read_text()) == render(), (
        "the support table in packages/vllm-elastic-kv/README.md is stale: run "
        "`python tests/vllm/vllm_support.py --write`"
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_served_family_has_its_engine_test(name: str) -> None:
    """``test_vllm_family_<name>.py`` exists and runs the family checks on ``FAMILIES[<name>]``."""
    path = Path(__file__).with_name(f"test_vllm_family_{name}.py")
    tree = ast.parse(path.read_text())
    source = ast.unparse(tree)
    assert f"FAMILIES[{name!r}]" in source, f"{path.name} does not test FAMILIES[{name!r}]"
    bases = {ast.unparse(b) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for b in node.bases}
    assert "FamilyChecks" in bases, f"{path.name} has no FamilyChecks class"


def test_every_served_spec_is_proven_by_a_family() -> None:
    proven = {FULL_ATTENTION[2]} | {
        spec for f in FAMILIES.values() for spec in SPECS if f" {spec} (" in f.groups
    }
    served = {name for name, support in SPECS.items() if support.served}
    assert served <= proven, f"served without an engine proof: {sorted(served - proven)}"
    assert (REPO_ROOT / FULL_ATTENTION_CPU).exists()


def test_refused_rows_are_refused_by_the_plugin() -> None:
    for row in REFUSED:
        if row.spec in SPECS:
            assert not SPECS[row.spec].served, f"{row.spec} is served: move its row to a family"
        else:  # refused outside the KV cache spec: by the worker (features) or the front end (activation)
            sources = inspect.getsource(features) + inspect.getsource(activation)
            assert row.spec in sources, f"no start-up refusal says {row.spec!r}"
