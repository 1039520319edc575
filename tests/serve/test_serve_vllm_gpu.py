"""``elastic-kv serve`` suspends a real vLLM engine on a GPU (marker ``gpu``; ``ci/gpu.sh``: ``serve-gpu``).

Two tiny Llamas (distinct random weights, float32 on Triton attention so that a recomputed request gives
the greedy tokens it gives uninterrupted, eager, the elastic KV cache, sleep mode into the server's host
arena) declared at 1 GiB of weights each in a 1.5 GiB budget: one is awake at a time. ``a`` decodes four
long streamed requests; a request to ``b`` finds no idle model to put to sleep and no room for a KV share,
so it suspends ``a`` (vLLM's ``POST /sleep?level=1&mode=keep``): ``a``'s requests are kept in its engine
without being preempted (the server starts its engines with ``ELASTIC_KV_PARK_KV=1``: their KV beyond the
null block's page is parked in host memory), its weights go to the arena. ``b`` answers; once ``b`` is
idle, ``a`` wakes and its requests go on from where they were, with the tokens they have when ``a`` serves
them alone.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from elastic_kv.registry import Registry

from tests.support.models import DISTINCT_SPECS, tiny_model
from tests.support.serve import ServeProcess

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

ARGS = ["--dtype", "float32", "--attention-backend", "TRITON_ATTN", "--max-model-len", "1024",
        "--enforce-eager", "--kv-cache-memory-bytes", "256M", "--gpu-memory-utilization", "0.05",
        "--seed", "0"]  # fmt: skip
PROMPTS = [f"pages are mapped when blocks are used, request {i}:" for i in range(4)]
LONG = 900  # tokens per request of a: seconds of decoding, so b's request arrives while they run


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("vllm")
    pytest.importorskip("elastic_kv_serve")
    models = [
        {"name": name, "engine": "vllm", "model": str(tiny_model(spec)), "args": ARGS, "weights_bytes": "1G",
         "idle_sleep_s": 0}
        for name, spec in zip("ab", DISTINCT_SPECS, strict=False)
    ]  # fmt: skip
    srv = ServeProcess(
        tmp_path_factory.mktemp("serve"),
        {"budget": "1536M", "host_budget": "3G", "host_arena_dir": "/dev/shm", "preload": True,
         "min_awake_s": 0, "max_suspend_s": 300, "wake_timeout_s": 600, "start_timeout_s": 600},
        models,
    )  # fmt: skip
    try:
        srv.wait_for({"a": "awake", "b": "asleep"}, timeout_s=600)
        yield srv
    finally:
        srv.stop()


def _stream(url: str, model: str, prompt: str, n: int, started: threading.Event | None = None) -> str:
    """The text of a streamed greedy completion of ``n`` tokens; ``started`` is set at its 16th chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    parts: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            parts += [c["text"] for c in json.loads(line[6:]).get("choices", [])]
            if started is not None and len(parts) >= 16:
                started.set()
    return "".join(parts)


def _preemptions(srv: ServeProcess, pool: str) -> int:
    """Requests the plugin counted as preempted in ``pool`` (its registry snapshot)."""
    (info,) = [p for p in Registry(srv.registry).pools() if p.name == pool]
    assert info.snapshot is not None
    return info.snapshot.preemptions


def test_a_serving_vllm_engine_is_suspended_for_another_and_its_requests_complete_alike(
    server: ServeProcess,
) -> None:
    with ThreadPoolExecutor(4) as pool:
        alone = list(pool.map(lambda p: _stream(server.url, "a", p, LONG), PROMPTS))
    assert all(alone) and len(set(alone)) == len(alone)
    preempted = _preemptions(server, "serve.a")

    starts = [threading.Event() for _ in PROMPTS]
    with ThreadPoolExecutor(4) as pool:
        kept = [
            pool.submit(_stream, server.url, "a", p, LONG, e) for p, e in zip(PROMPTS, starts, strict=True)
        ]
        for event in starts:
            assert event.wait(120), "a's requests did not start"
        other = _stream(server.url, "b", "the quick brown fox", 16)
        status = server.status()
        assert not any(f.done() for f in kept), "a's requests ended before b answered: nothing was suspended"
        results = [f.result(timeout=600) for f in kept]
    assert other
    assert results == alone, "a request kept through the suspension gave other tokens"
    (suspend,) = [t for t in status["a"]["transitions"] if t["kind"] == "suspend"]
    assert suspend["level"] == "1" and suspend["kept"] == len(PROMPTS)
    after = server.status()
    assert [t["kind"] for t in after["a"]["transitions"]][-2:] == ["suspend", "resume"]
    assert after["a"]["state"] == "awake" and not after["a"]["suspended"] and after["b"]["state"] == "asleep"
    # the requests running at the suspension went on where they were: none was preempted
    assert _preemptions(server, "serve.a") == preempted
