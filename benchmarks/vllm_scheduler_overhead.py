"""What the elastic pool adds to vLLM's scheduling work, without an engine (not a test).

vLLM's own ``KVCacheManager`` runs a simulated workload twice -- over vLLM's ``BlockPool`` and over the
``ElasticBlockPool`` with the real ledger and host data plane -- and the script reports the time per
``allocate_slots`` call and per request free. Each step's calls run as in the elastic scheduler's
``schedule()``, with the pool counting only the blocks it holds (``ElasticBlockPool.counting``). The
workload is the scheduler's: ``--requests`` prompts admitted, then ``--steps`` decode steps in which every
running request gets one token (a new block every ``block size`` tokens), then all freed. Runs alternate
and the best of ``--rounds`` counts, so a shared machine's noise mostly cancels. This isolates the
plugin's Python cost on the scheduling thread, which end-to-end throughput on a busy 2-core machine cannot
resolve.

    python benchmarks/vllm_scheduler_overhead.py [--requests 256] [--steps 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(ROOT))

from benchmarks.workload import workload_parser  # noqa: E402


def _stacks(elastic: bool, num_blocks: int) -> tuple[Any, Any]:
    import test_vllm_block_pool as t

    t.NUM_BLOCKS = num_blocks
    if elastic:
        # ElasticConfig's default reserve; 32 blocks (16 tokens each) per page, like a GPU's 2 MiB pages.
        stack = t._stack(reserve=(1, 16), blocks_per_page=32)
        return stack.manager, stack
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    manager = KVCacheManager(
        t._kv_cache_config(), max_model_len=4096, scheduler_block_size=t.BLOCK, hash_block_size=t.BLOCK
    )
    stack = t.Stack(manager, None, None, None, None, iter(range(1, 1 << 30)))  # type: ignore[arg-type]
    stack.hasher = get_request_block_hasher(t.BLOCK, sha256)
    return manager, stack


def _run(elastic: bool, args: argparse.Namespace) -> dict[str, float]:
    block = 16
    per_request = -(-(args.prompt + args.steps) // block) + 2
    manager, stack = _stacks(elastic, args.requests * per_request + 64)
    requests = [
        stack.request([(7 * i + j) % 997 + 3 for j in range(args.prompt)]) for i in range(args.requests)
    ]
    # Each step as the elastic scheduler's ``schedule()`` runs it: counting only the blocks the pool holds.
    step = stack.pool.counting if elastic else lambda backed_only: contextlib.nullcontext()
    calls = 0
    t0 = time.perf_counter()
    with step(backed_only=True):
        for req in requests:
            assert manager.allocate_slots(req, req.num_tokens) is not None
            req.num_computed_tokens = req.num_tokens
            calls += 1
    for _ in range(args.steps):
        with step(backed_only=True):
            for req in requests:
                req.append_output_token_ids(5)
                assert manager.allocate_slots(req, 1, num_lookahead_tokens=0) is not None
                req.num_computed_tokens += 1
                calls += 1
    t1 = time.perf_counter()
    for req in requests:
        manager.free(req)
    t2 = time.perf_counter()
    return {"us_per_allocate": (t1 - t0) / calls * 1e6, "us_per_free": (t2 - t1) / len(requests) * 1e6}


def main() -> None:
    parser = workload_parser(__doc__, requests=256, output=False)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, elastic in (("native", False), ("elastic", True)):
            run = _run(elastic, args)
            prev = best.get(name)
            best[name] = run if prev is None else {k: min(v, prev[k]) for k, v in run.items()}
    native, elastic = best["native"], best["elastic"]
    per_step_us = (elastic["us_per_allocate"] - native["us_per_allocate"]) * args.requests
    print(
        json.dumps(
            {
                "native": {k: round(v, 2) for k, v in native.items()},
                "elastic": {k: round(v, 2) for k, v in elastic.items()},
                "allocate_ratio": round(elastic["us_per_allocate"] / native["us_per_allocate"], 3),
                "added_us_per_decode_step": round(per_step_us, 1),
                "requests": args.requests,
            }
        )
    )


if __name__ == "__main__":
    main()
