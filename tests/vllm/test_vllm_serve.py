"""``vllm serve ... --kv-cache-backend=elastic``: OpenAI completions, ``kvctl list``, ``kvctl limit``, and the
scheduler's side of a suspension (what ``elastic-kv serve`` asks of an engine it suspends).

The server is vLLM's OpenAI API server module, started with the plugin's flag
(:func:`vllm_engines.openai_server`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from vllm_engines import kvctl, openai_server, tiny_model, wait_for

pytestmark = pytest.mark.vllm

POOL = "test-serve"


@pytest.fixture(scope="module")
def server(registry_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # /sleep, /wake_up, /collective_rpc; a suspension parks its requests' KV (as under elastic-kv serve)
    dev_mode = {"VLLM_SERVER_DEV_MODE": "1", "ELASTIC_KV_PARK_KV": "1"}
    with openai_server(registry_dir, POOL, log, "vllm-serve/server.log", dev_mode) as (_, url):
        yield url


def _complete(url: str, prompt: str, max_tokens: int = 16) -> dict[str, Any]:
    reply = requests.post(
        f"{url}/v1/completions",
        json={
            "model": str(tiny_model()),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def _listed(registry_dir: Path) -> dict[str, Any]:
    (pool,) = json.loads(kvctl(registry_dir, "list", "--json").stdout)["pools"]
    return pool  # type: ignore[no-any-return]


def _metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_openai_completion(server: str) -> None:
    body = _complete(server, "the quick brown fox jumps over the lazy dog.")
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 16 and choice["text"]


def test_kvctl_lists_the_pool(server: str, registry_dir: Path) -> None:
    done = kvctl(registry_dir, "list", "--json")
    assert done.returncode == 0, done.stderr
    pools = {p["name"]: p for p in json.loads(done.stdout)["pools"]}
    assert POOL in pools
    pool = pools[POOL]
    assert pool["engine"] == "vllm" and pool["snapshot"]["total_blocks"] == 512


def test_kvctl_limit_makes_the_server_preempt_not_fail(server: str, registry_dir: Path) -> None:
    page = _listed(registry_dir)["snapshot"]["page_bytes"]
    done = kvctl(registry_dir, "limit", POOL, str(12 * page))
    assert done.returncode == 0, done.stderr
    try:
        before = _metric(server, "vllm:num_preemptions_total")
        # ~240 tokens: 2 blocks of 128 at admission, a third one while decoding 64 tokens -> preemption
        text = "pages are mapped when blocks are used and unmapped when they are free. " * 17
        with ThreadPoolExecutor(8) as pool:
            bodies = list(pool.map(lambda i: _complete(server, f"{i} {text}", max_tokens=64), range(8)))
        assert all(b["usage"]["completion_tokens"] == 64 for b in bodies)
        assert _metric(server, "vllm:num_preemptions_total") > before
        assert _listed(registry_dir)["charged_bytes"] <= 12 * page
    finally:
        kvctl(registry_dir, "limit", POOL, "unlimited")
    assert requests.get(f"{server}/health", timeout=5).status_code == 200  # still serving


def _stream(url: str, prompt: str, max_tokens: int, chunks: list[float]) -> str:
    """A streamed greedy completion's text; the arrival time of each chunk is appended to ``chunks``."""
    body = {"model": str(tiny_model()), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    parts = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=300) as reply:
        assert reply.status_code == 200, reply.text
        for line in reply.iter_lines(decode_unicode=True):
            if line and line.startswith("data: ") and line != "data: [DONE]":
                parts += [c["text"] for c in json.loads(line[6:])["choices"]]
                chunks.append(time.monotonic())
    return "".join(parts)


def _info(url: str) -> dict[str, Any]:
    """The one worker's ``elastic_kv_info`` (vLLM's dev-mode ``/collective_rpc``)."""
    reply = requests.post(f"{url}/collective_rpc", json={"method": "elastic_kv_info"}, timeout=60)
    reply.raise_for_status()
    (info,) = reply.json()["results"]
    return info  # type: ignore[no-any-return]


def test_a_suspension_parks_the_kv_in_host_memory_and_resumes_the_requests_where_they_were(
    server: str, registry_dir: Path
) -> None:
    """``POST /sleep?level=1&mode=keep`` (what ``elastic-kv serve`` asks of an engine it suspends): the
    scheduler pauses with its requests running and leaves them their blocks; the worker parks every mapped
    page but the null block's in host memory, so the device holds none of the requests' KV (the pool's charge
    stays: the ledger still counts the pages as its own); an aborted request meanwhile, and a device budget
    change, map nothing; the wake-up brings the pages back and the kept requests go on from where they were --
    none is preempted to be computed again -- each completing with the tokens it has uninterrupted."""
    prompts = [
        f"{i} pages are mapped when blocks are used and unmapped when they are free." for i in range(4)
    ]
    with ThreadPoolExecutor(4) as pool:
        alone = list(pool.map(lambda p: _stream(server, p, 300, []), prompts))
    chunks: list[list[float]] = [[] for _ in prompts]
    preempted = _listed(registry_dir)["snapshot"]["preemptions"]
    body = {"model": str(tiny_model()), "prompt": "left while asleep", "max_tokens": 300, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with (
        ThreadPoolExecutor(4) as pool,
        requests.post(f"{server}/v1/completions", json=body, stream=True, timeout=300) as leaving,
    ):
        kept = [pool.submit(_stream, server, p, 300, c) for p, c in zip(prompts, chunks, strict=True)]
        assert wait_for(lambda: all(len(c) >= 8 for c in chunks), timeout=120)
        charged = _listed(registry_dir)["charged_bytes"]
        awake = _info(server)
        requests.post(f"{server}/sleep?level=1&mode=keep", timeout=60).raise_for_status()
        paused_at = time.monotonic()
        asleep = _info(server)
        assert asleep["parked_bytes"] > 0 and asleep["mapped_pages"] == 1, asleep  # the null block's page
        # Every page's memory went back (what stays live is the zero page the spaces show meanwhile).
        assert awake["live_bytes"] - asleep["live_bytes"] >= asleep["parked_bytes"], (awake, asleep)
        assert _listed(registry_dir)["charged_bytes"] >= asleep["parked_bytes"]
        leaving.close()  # its client leaves: vLLM aborts it while its blocks are parked
        done = kvctl(registry_dir, "budget", "cpu", str(4 * charged))
        assert done.returncode == 0, done.stderr
        time.sleep(1.0)  # the idle engine applies the budget change (IdleControl) meanwhile
        assert _info(server)["live_bytes"] == asleep["live_bytes"], "the asleep pool mapped pages again"
        assert not any(f.done() for f in kept)
        requests.post(f"{server}/wake_up", timeout=60).raise_for_status()
        assert _info(server)["parked_bytes"] == 0
        resumed = [f.result(timeout=300) for f in kept]
    kvctl(registry_dir, "budget", "cpu", "unlimited")
    assert resumed == alone
    assert _listed(registry_dir)["snapshot"]["preemptions"] == preempted, "a kept request was recomputed"
    # Every request streamed on after the wake (vLLM may put several tokens in one chunk when the client
    # lags, so chunks are not counted as tokens).
    assert all(c[-1] > paused_at + 1.0 for c in chunks)
    late = [t for c in chunks for t in c if paused_at < t < paused_at + 1.0]
    assert not late, "tokens came while the engine slept"


def test_without_park_kv_a_suspension_preempts_its_requests_as_vllm_does(
    registry_dir: Path, tmp_path: Path
) -> None:
    """vLLM's own behaviour where ``ELASTIC_KV_PARK_KV`` is not set (any engine but ``elastic-kv serve``'s,
    whose weights might change while asleep): ``/sleep?level=1&mode=keep`` preempts the running requests,
    the pool falls to the null block's page and nothing is parked; after the wake-up they are computed
    again and complete with the tokens they have uninterrupted."""
    dev_mode = {"VLLM_SERVER_DEV_MODE": "1", "ELASTIC_KV_PARK_KV": "0"}
    log = tmp_path / "server.log"
    with openai_server(registry_dir, POOL + "-native", log, "vllm-serve/native.log", dev_mode) as (_, url):
        prompts = [f"{i} blocks are computed again after a preemption." for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            alone = list(pool.map(lambda p: _stream(url, p, 200, []), prompts))
        chunks: list[list[float]] = [[] for _ in prompts]
        with ThreadPoolExecutor(3) as pool:
            kept = [pool.submit(_stream, url, p, 200, c) for p, c in zip(prompts, chunks, strict=True)]
            assert wait_for(lambda: all(len(c) >= 8 for c in chunks), timeout=120)
            requests.post(f"{url}/sleep?level=1&mode=keep", timeout=60).raise_for_status()
            asleep = _info(url)
            assert asleep["parked_bytes"] == 0 and asleep["mapped_pages"] == 1, asleep
            assert not any(f.done() for f in kept)
            requests.post(f"{url}/wake_up", timeout=60).raise_for_status()
            resumed = [f.result(timeout=300) for f in kept]
        assert resumed == alone
        (pool_,) = [p for p in json.loads(kvctl(registry_dir, "list", "--json").stdout)["pools"]
                    if p["name"] == POOL + "-native"]  # fmt: skip
        assert pool_["snapshot"]["preemptions"] >= len(prompts)
