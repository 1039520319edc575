"""Real engines of odd shapes (1, 3 and 7 layers; head sizes 64, 80 and 96; KV sizes no multiple of a
block, slot or page): the elastic engine starts and its greedy tokens equal native vLLM's.

The first two shapes are issue 19's 3-layer Llama, which failed at start-up in the worker (``extent 2: page
42 ends beyond the space``) because the worker reserved the buffer rounded up to a slot, not the space the
plan's last page needs. The module runs every engine once (:func:`vllm_shapes.run_shapes`: the native and
the elastic engines in two interpreters side by side, one engine alive in each at a time).
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_shapes import SHAPES, run_shapes

pytestmark = pytest.mark.vllm

MIB = 1 << 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_shapes(list(SHAPES), tmp_path_factory.mktemp("registry"))


@pytest.mark.parametrize("name", list(SHAPES))
def test_elastic_tokens_equal_native(runs: dict[str, dict[str, Any]], name: str) -> None:
    native = runs["native"][SHAPES[name].native or name]["tokens"]
    cold, warm = runs["elastic"][name]["tokens"]
    assert cold == native
    assert warm == native  # the shared prefix and every whole prompt block now hit the prefix cache


@pytest.mark.parametrize(
    ("name", "blocks", "last_page"), [("l3-h64-256mib", 682, 42), ("l3-h64-cpu-space-1g", 2730, 170)]
)
def test_issue19_spaces_cover_the_last_page(
    runs: dict[str, dict[str, Any]], name: str, blocks: int, last_page: int
) -> None:
    """682 (2730) blocks, 16 a page: the last page's extent of layer 2 ends 512 KiB past the buffer rounded
    up to a 2 MiB slot, so the space the worker reserves is one slot larger than that."""
    plan = runs["elastic"][name]
    assert (plan["num_blocks"], plan["blocks_per_page"], plan["num_pages"]) == (blocks, 16, last_page + 1)
    rounded = -(-plan["buffer_bytes"] // (2 * MIB)) * 2 * MIB
    assert plan["reserved"] == plan["space_sizes"] == [rounded + 2 * MIB]


def test_every_shape_has_a_short_last_page(runs: dict[str, dict[str, Any]]) -> None:
    """The shapes exercise what broke: a block count that is no multiple of the blocks per page."""
    for name in SHAPES:
        plan = runs["elastic"][name]
        assert plan["num_blocks"] % plan["blocks_per_page"], name
        assert plan["reserved"] == plan["space_sizes"], name


def test_small_pool_serves_from_its_last_page(runs: dict[str, dict[str, Any]]) -> None:
    """With 13 blocks, 8 a page, the prompts need blocks of the short last page (blocks 8-12), and get
    them."""
    plan = runs["elastic"]["l7-h96-13-blocks"]
    assert (plan["num_blocks"], plan["blocks_per_page"], plan["num_pages"]) == (13, 8, 2)
    assert plan["highest_block"] >= 8
