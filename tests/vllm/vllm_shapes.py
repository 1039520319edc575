"""Tiny Llama models of odd shapes, each served by a native and an elastic vLLM engine.

``python tests/vllm/vllm_shapes.py native|elastic NAME...`` starts one engine per named shape in this
process (the engine core and worker in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one at a time, and
prints JSON: per shape the greedy tokens of :func:`shape_prompts` (the elastic engine runs them twice, the
second pass on a warm prefix cache) and, for the elastic engine, the pool's plan and the highest block id
it handed out. :func:`run_shapes` runs both modes side by side for ``test_vllm_shapes.py``; the native run
does not even load the plugin (``VLLM_PLUGINS=""``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from vllm_engines import generate, prompts  # noqa: E402

from tests.support import engine_logs  # noqa: E402
from tests.support.models import TinyModelSpec, tiny_model  # noqa: E402

MIB = 1 << 20


@dataclass(frozen=True)
class Shape:
    """A model and the KV cache vLLM sizes for it (``kv_cache_memory_bytes``, and environment variables of
    the elastic engine such as ``VLLM_CPU_KVCACHE_SPACE``)."""

    model: TinyModelSpec
    kv_bytes: int
    elastic_env: dict[str, str] = field(default_factory=dict)
    # The shape whose native tokens this one's elastic tokens must equal (its own when empty).
    native: str = ""


_ISSUE19 = TinyModelSpec(
    name="tiny-llama-l3-h256",
    hidden_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SHAPES: dict[str, Shape] = {
    # Issue 19: 682 blocks of 3 x 128 KiB in 256 MiB, 16 blocks a 2 MiB page (the last page short).
    "l3-h64-256mib": Shape(_ISSUE19, 256 * MIB),
    # The same with VLLM_CPU_KVCACHE_SPACE=1, which vLLM's CPU platform lets override the byte setting:
    # 2730 blocks in 1 GiB (virtual: the elastic engine backs what it uses).
    "l3-h64-cpu-space-1g": Shape(
        _ISSUE19, 256 * MIB, {"VLLM_CPU_KVCACHE_SPACE": "1"}, native="l3-h64-256mib"
    ),
    # One layer, head size 80: 80 KiB blocks, 128 a page (5 slots), 473 blocks.
    "l1-h80": Shape(
        TinyModelSpec(
            name="tiny-llama-l1-h80",
            hidden_size=320,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=1,
        ),
        37 * MIB + 4321,
    ),
    # Seven layers, head size 96 (192 KiB a layer's block), 512 KiB slots: 8 blocks a page (3 slots per
    # layer), layers not slot-aligned, and only 13 blocks (two pages, the second of 5 blocks): the prompts
    # need more blocks at once than the first page holds (vLLM preempts and recomputes when all are taken).
    "l7-h96-13-blocks": Shape(
        TinyModelSpec(
            name="tiny-llama-l7-h96",
            hidden_size=384,
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        13 * 7 * 192 * 1024 + 1000,
        {"ELASTIC_KV_PAGE_SIZE": "512K"},
    ),
}


def shape_prompts() -> list[list[int]]:
    """Six prompts of 3 to 520 tokens (19 blocks of 128 tokens at once), across block boundaries, three
    sharing a 300-token prefix."""
    every = prompts()
    return [every[i] for i in (0, 4, 7, 8, 10, 11)]


def _engine(shape: Shape, elastic: bool, name: str) -> Any:
    from vllm import LLM

    extra: dict[str, Any] = {}
    if elastic:
        extra["additional_config"] = {"kv_cache_backend": "elastic", "elastic_kv": {"pool_name": name}}
    return LLM(
        model=str(tiny_model(shape.model)),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        kv_cache_memory_bytes=shape.kv_bytes,
        enable_prefix_caching=True,
        seed=0,
        **extra,
    )


def _serve(name: str, elastic: bool) -> dict[str, Any]:
    """Start shape ``name``'s engine, generate, shut it down; tokens and (elastic) the pool's plan."""
    shape = SHAPES[name]
    env = shape.elastic_env if elastic else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = _engine(shape, elastic, name)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    result: dict[str, Any] = {}
    try:
        if not elastic:
            result["tokens"] = generate(llm, shape_prompts())
            return result
        core = llm.llm_engine.engine_core.engine_core
        pool = core.scheduler.elastic_pool
        highest = [0]
        alloc = pool.ledger.alloc

        def recorded(n: int) -> list[int] | None:
            ids = alloc(n)
            if ids:
                highest[0] = max(highest[0], *ids)
            return ids

        pool.ledger.alloc = recorded
        result["tokens"] = [generate(llm, shape_prompts()), generate(llm, shape_prompts())]
        geo = pool.geometry
        worker_geo = core.model_executor.driver_worker.worker._elastic_pool
        result.update(
            num_blocks=geo.num_blocks,
            blocks_per_page=geo.blocks_per_page,
            num_pages=geo.num_pages,
            space_sizes=list(geo.space_sizes),
            buffer_bytes=core.scheduler.kv_cache_config.kv_cache_tensors[0].size,
            reserved=[s.size for s in worker_geo.spaces],
            highest_block=highest[0],
        )
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def run_shapes(names: Sequence[str], registry_dir: Path, timeout: float = 900) -> dict[str, dict[str, Any]]:
    """Both modes for ``names`` in two interpreters side by side: ``{"native": ..., "elastic": ...}``."""
    log_dir = REPO_ROOT / ".cache"
    log_dir.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    natives = sorted({SHAPES[n].native or n for n in names})
    jobs = {
        "native": ([*natives], {**base, "VLLM_PLUGINS": "", "ELASTIC_KV_BACKEND": ""}),
        "elastic": ([*names], {**base, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}),
    }
    procs = {}
    for mode, (shapes, env) in jobs.items():
        log = open(log_dir / f"vllm-shapes-{mode}.log", "w")  # noqa: SIM115 - closed below
        procs[mode] = (
            subprocess.Popen(
                [sys.executable, __file__, mode, *shapes], env=env, stdout=subprocess.PIPE, stderr=log
            ),
            log,
        )
    results: dict[str, dict[str, Any]] = {}
    for mode, (proc, log) in procs.items():
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        if proc.returncode != 0:
            why = engine_logs.tail(Path(log.name))
            raise RuntimeError(f"the {mode} engines failed (see {log.name}):\n{why}")
        results[mode] = json.loads(out.decode().strip().splitlines()[-1])
    return results


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] in ("native", "elastic"):
    elastic_mode = sys.argv[1] == "elastic"
    print(json.dumps({name: _serve(name, elastic_mode) for name in sys.argv[2:]}), flush=True)
