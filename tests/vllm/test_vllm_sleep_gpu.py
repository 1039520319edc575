"""Sleep mode into the host arena on a GPU (marker ``gpu``; run by ``ci/gpu.sh``, group ``vllm-sleep``).

One real vLLM engine (a small Llama with saved random weights, bfloat16, eager) with the elastic KV cache,
``enable_sleep_mode`` and a host arena (``ELASTIC_KV_HOST_ARENA``), so the plugin selects its ``elastic``
sleep-mode backend. The tests run in file order on that engine:

* a level-1 sleep while this process keeps allocating GPU memory beside the engine (a neighbour growing):
  vLLM's own closing check would fail that sleep; the weights sit in one arena extent while asleep, come
  back bit for bit (greedy tokens equal), and the extent goes back to the arena on wake-up;
* the whole arena pinned once (``elastic_kv_pin_host``), then another sleep and wake-up;
* level 2 (weights discarded, reloaded with ``reload_weights``) leaves the arena alone and answers alike;
* a level-1 sleep demoted to level 2 (``elastic_kv_demote``, what ``elastic-kv serve`` does to give the
  arena to a model used more recently): the extent goes back at once, the buffers (the rotary tables, which
  ``reload_weights`` does not restore) are kept, and level 2's wake-up answers alike;
* a sleep that keeps its requests in the middle of a batch (``ELASTIC_KV_PARK_KV=1``, as ``elastic-kv serve``
  starts its engines): their KV parked in the arena and brought back, the same tokens, no recompute.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_engines import gpu_elastic_llm

from tests.support.models import TinyModelSpec, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

MiB = 1 << 20
POOL = "sleep-gpu"
SPEC = TinyModelSpec(
    name="sleep-llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4
)
PROMPTS = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 16 for j in range(48 + 16 * i)]} for i in range(6)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from elastic_kv.host import HostArena

    registry = tmp_path_factory.mktemp("registry")
    registry.chmod(0o700)
    arena = HostArena.create(Path("/dev/shm") / f"sleep-gpu-{os.getpid()}.arena", 256 * MiB)
    mp = pytest.MonkeyPatch()
    mp.setenv("ELASTIC_KV_HOST_ARENA", str(arena.path))
    mp.setenv("ELASTIC_KV_PARK_KV", "1")  # as elastic-kv serve starts its engines
    try:
        with gpu_elastic_llm(registry, tiny_model(SPEC), POOL, enable_sleep_mode=True) as llm:
            yield {"llm": llm, "arena": arena, "tokens": _generate(llm)}
    finally:
        mp.undo()
        arena.close()
        arena.remove()


def _generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_elastic_backend_is_selected(engine: dict[str, Any]) -> None:
    config = engine["llm"].llm_engine.vllm_config.model_config
    assert config.sleep_mode_backend == "elastic"


def test_a_level_1_sleep_beside_a_growing_neighbour_keeps_the_weights_in_the_arena(
    engine: dict[str, Any],
) -> None:
    import torch

    llm, arena = engine["llm"], engine["arena"]
    grown: list[Any] = []
    done = threading.Event()

    def neighbour() -> None:  # allocate beside the engine until its sleep returns (at most 8 GiB)
        while not done.is_set() and len(grown) < 128:
            grown.append(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        llm.sleep(level=1)
    finally:
        done.set()
        thread.join()
    assert grown, "the neighbour allocated nothing during the sleep"
    taken = arena.extents()
    assert [e.owner for e in taken] == [POOL] and taken[0].size > 0
    del grown[:]
    torch.cuda.empty_cache()
    llm.wake_up()
    assert arena.extents() == []
    assert _generate(llm) == engine["tokens"]


def test_the_whole_arena_pinned_once_then_sleep_and_wake(engine: dict[str, Any]) -> None:
    llm, arena = engine["llm"], engine["arena"]
    (pinned,) = llm.collective_rpc("elastic_kv_pin_host")
    assert pinned["pinned_bytes"] == arena.size
    llm.sleep(level=1)
    (extent,) = arena.extents()
    assert extent.size == pinned["level_one_bytes"] > 0  # what elastic-kv serve plans the arena with
    llm.wake_up()
    assert arena.extents() == [] and _generate(llm) == engine["tokens"]


def test_level_2_discards_the_weights_and_leaves_the_arena_alone(engine: dict[str, Any]) -> None:
    llm, arena = engine["llm"], engine["arena"]
    llm.sleep(level=2)
    assert arena.extents() == []
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert _generate(llm) == engine["tokens"]


def test_a_level_1_sleep_demoted_to_level_2_gives_the_arena_back_and_answers_alike(
    engine: dict[str, Any],
) -> None:
    llm, arena = engine["llm"], engine["arena"]
    llm.sleep(level=1)
    (extent,) = arena.extents()
    (demoted,) = llm.collective_rpc("elastic_kv_demote")
    assert demoted == {"freed_bytes": extent.size, "buffers": demoted["buffers"]} and demoted["buffers"] > 0
    assert arena.extents() == []
    with pytest.raises(Exception, match="not asleep in the host arena"):
        llm.collective_rpc("elastic_kv_demote")
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert _generate(llm) == engine["tokens"]


def test_a_sleep_that_keeps_its_requests_parks_their_kv_and_they_go_on_alike(engine: dict[str, Any]) -> None:
    """``sleep(level=1, mode="keep")`` in the middle of a batch (what ``elastic-kv serve`` does to suspend a
    serving model): the requests keep their blocks, the worker parks their pages in the host arena beside
    the weights, so the device holds only the null block's page; the wake-up brings them back and the
    requests go on without being computed again (no preemption), each with the tokens it has
    uninterrupted. Under async scheduling, the engine's per-request state on the device (on vLLM 0.26 in
    the pool its sleep discards) must come back as well, or the next step decodes from garbage."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm, arena = engine["llm"], engine["arena"]
    core = llm.llm_engine
    # Enough requests that, at the sleep, their blocks fill the null block's page and two more: a page holds
    # thousands of this model's tokens.
    (idle,) = llm.collective_rpc("elastic_kv_info")
    blocks_per_page = int(re.search(r"(\d+) blocks/page", idle["geometry"]).group(1))
    page_tokens = blocks_per_page * core.vllm_config.cache_config.block_size
    held = 2 * page_tokens
    prompts = [[(11 * i + 5 * j) % 1000 + 16 for j in range(64)] for i in range(held // 512 + 2)]
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.reset_prefix_cache()
    alone = [list(o.outputs[0].token_ids) for o in llm.generate(_inputs(prompts), params, use_tqdm=False)]
    llm.reset_prefix_cache()  # the kept run computes its prompts as the first run did

    streamed = params.clone()
    streamed.output_kind = RequestOutputKind.CUMULATIVE  # each step's tokens, not only the last
    for i, prompt in enumerate(_inputs(prompts)):
        core.add_request(f"kept-{i}", prompt, streamed)
    outputs: dict[str, list[int]] = {}
    while len(outputs) < len(prompts) or sum(64 + len(t) for t in outputs.values()) < held:
        for out in core.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
    (awake,) = llm.collective_rpc("elastic_kv_info")
    llm.sleep(level=1, mode="keep")
    assert core.has_unfinished_requests(), "the requests ended before the sleep: nothing was kept"
    (asleep,) = llm.collective_rpc("elastic_kv_info")
    assert asleep["parked_bytes"] > 0 and asleep["mapped_pages"] == 1, asleep  # the null block's page
    assert awake["live_bytes"] - asleep["live_bytes"] >= asleep["parked_bytes"], (awake, asleep)
    assert len(arena.extents()) == 2  # the weights' copy (with the engine's state) and the KV's
    llm.wake_up()
    (woken,) = llm.collective_rpc("elastic_kv_info")
    assert woken["parked_bytes"] == 0 and arena.extents() == []
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
    assert [outputs[f"kept-{i}"] for i in range(len(prompts))] == alone


def _inputs(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]
