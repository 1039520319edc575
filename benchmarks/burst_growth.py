"""A burst from idle, on the real ledger: how long does the engine's scheduling thread wait for the driver?

An idle elastic pool holds nearly nothing, so a burst's first steps need pages mapped *now*. On a GPU
(Llama-3-8B's shape, 256 MiB pages of 32 handles each) a page costs the worker a few milliseconds of
driver time, and a 256-request burst's first prefill step needs 8 of them (``docs/results.md``). This
script replays that burst's allocation pattern against the
real ledger, the real ``CoordinatorMapper`` (its background thread, as in the vLLM plugin) and a real
``SpaceGroup`` on host memory whose driver is slowed to a given cost per page (the data plane's fault
injector), with the engine's GPU time as sleeps:

* arrivals: ``--requests`` requests of ``--prompt`` tokens, ``--arrival-us`` apart (vLLM's ``add_request``);
* prefill: steps of ``--step-tokens`` tokens (``--prefill-ms`` of GPU each), one ``alloc`` per request;
* decode: ``--output`` steps (``--decode-ms`` each), a new block per request every 16 tokens, maintained
  as light steps (``Ledger.maintain(light=True)``, as the vLLM plugin does for decode steps; with
  ``--heavy-decode`` like prefill steps);
* idle: every block freed, the pool settled and its reserve trimmed to ``--reserve-min`` pages, as at the
  engine's idle transition, then ``--idle-ms`` without work (on the GPU, the other engine's burst).

It runs the burst with and without telling the ledger about the arrivals (``Ledger.expect``, which
the vLLM plugin calls from the scheduler's ``add_request``), alternating, and reports the scheduler thread's
time inside ``alloc`` per burst -- waits for background maps and synchronous maps -- and the pages the
driver mapped while prefill and while decode steps ran. The driver's cost is a
model (``--page-ms``; measure it with ``ci/gpu_vllm.py``'s timeline), not the GPU: the numbers show where
the waits come from and what each policy leaves on the critical path, not an engine's throughput.

    python benchmarks/burst_growth.py [--page-ms 6.4] [--requests 256] [--bursts 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import LocalMapper
from elastic_kv.ranks import CoordinatorMapper

logger = logging.getLogger("burst_growth")

BLOCK_TOKENS = 16
LAYERS = 32  # one map call (handle) per layer and page, as with vLLM 0.26's per-layer KV tensors
BLOCKS_PER_PAGE = 128
LAYER_BLOCK_BYTES = 4096  # host memory stands in for the GPU's: small blocks, the same page structure


def _pool(args: argparse.Namespace) -> tuple[Ledger, CoordinatorMapper, LocalMapper, _vmm.Backend]:
    blocks_needed = args.requests * -(-(args.prompt + args.output) // BLOCK_TOKENS)
    pages = 2 * -(-blocks_needed // BLOCKS_PER_PAGE) + args.reserve_max
    nb = pages * BLOCKS_PER_PAGE
    geometry = BlockGeometry.from_layer_strides(
        LAYERS * nb * LAYER_BLOCK_BYTES,
        nb,
        LAYERS,
        nb * LAYER_BLOCK_BYTES,
        LAYER_BLOCK_BYTES,
        LAYER_BLOCK_BYTES,
        BLOCKS_PER_PAGE * LAYER_BLOCK_BYTES,
    )
    driver = _vmm.FaultInjectingBackend(_vmm.HostBackend(granularity=geometry.page_size))
    # A page costs one handle per layer, created fresh (no handle cache); releases stay cheap, as measured.
    driver.delay("create", args.page_ms / 1000 / LAYERS)
    local = LocalMapper.for_geometry(driver, geometry)
    mapper = CoordinatorMapper(local, name="burst-growth-mapper")
    config = ElasticConfig(
        page_size=geometry.page_size,
        reserve_min_pages=args.reserve_min,
        reserve_max_pages=args.reserve_max,
        premap=True,
    )
    return Ledger(geometry, mapper, config), mapper, local, driver


def _burst(ledger: Ledger, driver: _vmm.Backend, args: argparse.Namespace, expect: bool) -> dict[str, float]:
    """One burst from idle: seconds the scheduling thread spent in ``alloc``, by phase, and the pages the
    driver created in the prefill and the decode phase."""
    created = driver.calls("create")
    prompt_blocks = -(-args.prompt // BLOCK_TOKENS)
    arriving = 0
    for _ in range(args.requests):
        arriving += prompt_blocks
        if expect:
            ledger.expect(arriving)
        time.sleep(args.arrival_us / 1e6)
    spent = {"first step": 0.0, "prefill": 0.0, "decode": 0.0}
    live: list[list[int]] = []
    per_step = max(1, args.step_tokens // args.prompt)
    for first in range(0, args.requests, per_step):
        t0 = time.perf_counter()
        for _ in range(min(per_step, args.requests - first)):
            blocks = ledger.alloc(prompt_blocks)
            assert blocks is not None, "the pool is sized for the burst"
            live.append(blocks)
        waited = time.perf_counter() - t0
        spent["prefill"] += waited
        if first == 0:
            spent["first step"] = waited
        ledger.advance_epoch()
        ledger.maintain()
        time.sleep(args.prefill_ms / 1000)
    spent["prefill pages"] = (driver.calls("create") - created) / LAYERS
    created = driver.calls("create")
    for step in range(args.output):
        t0 = time.perf_counter()
        if (args.prompt + step) % BLOCK_TOKENS == 0:
            for _ in range(args.requests):
                blocks = ledger.alloc(1)
                assert blocks is not None
                live.append(blocks)
        spent["decode"] += time.perf_counter() - t0
        ledger.advance_epoch()
        ledger.maintain(light=not args.heavy_decode)  # as the vLLM plugin does for decode steps
        time.sleep(args.decode_ms / 1000)
    spent["decode pages"] = (driver.calls("create") - created) / LAYERS
    for blocks in live:
        ledger.free(blocks)
    # The vLLM plugin's idle transition (SchedulerPool.settle_idle): no step runs while idle.
    ledger.settle()
    ledger.trim(keep=args.reserve_min)
    time.sleep(args.idle_ms / 1000)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-ms", type=float, default=6.4, help="driver time to map one page")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--output", type=int, default=128, help="decode steps")
    parser.add_argument("--arrival-us", type=float, default=100.0, help="time between two add_request")
    parser.add_argument("--step-tokens", type=int, default=16384, help="prefill tokens per step")
    parser.add_argument("--prefill-ms", type=float, default=450.0, help="GPU time of a prefill step")
    parser.add_argument("--decode-ms", type=float, default=10.0, help="GPU time of a decode step")
    parser.add_argument("--idle-ms", type=float, default=500.0, help="idle time after a burst")
    parser.add_argument("--reserve-min", type=int, default=1, help="reserve_min_pages (kept while idle)")
    parser.add_argument("--reserve-max", type=int, default=16, help="reserve_max_pages")
    parser.add_argument("--bursts", type=int, default=3, help="bursts per policy (alternating)")
    parser.add_argument(
        "--heavy-decode",
        action="store_true",
        help="maintain decode steps like prefill steps (the reserve refilled up to what prefill took)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    ledger, mapper, local, driver = _pool(args)
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        ledger.maintain()
        ledger.settle()
        for burst in range(args.bursts):
            for expect in (burst % 2 == 0, burst % 2 == 1):  # alternate which policy goes first
                results[expect].append(_burst(ledger, driver, args, expect))
                logger.info(
                    "burst %d/%d, arrivals %s: done", burst + 1, args.bursts, "told" if expect else "not told"
                )
    finally:
        ledger.close()
        mapper.close()
        local.close()

    print(
        f"{args.requests} requests x {args.prompt} prompt tokens, {args.output} decode steps; driver "
        f"{args.page_ms} ms per page ({LAYERS} handles); arrivals {args.arrival_us} us apart"
    )
    print(
        "per burst (median of bursts): scheduler thread in alloc, ms: first step / prefill / decode; "
        "pages mapped in the prefill / decode phase (decode steps maintained as "
        f"{'heavy' if args.heavy_decode else 'light'})"
    )
    for expect, label in (
        (False, "arrivals not told (the ledger's reserve alone)"),
        (True, "arrivals told (expect)"),
    ):
        ms = [
            statistics.median(r[k] for r in results[expect]) * 1000
            for k in ("first step", "prefill", "decode")
        ]
        pages = [statistics.median(r[k] for r in results[expect]) for k in ("prefill pages", "decode pages")]
        print(
            f"  {label}: "
            + " / ".join(f"{c:.1f}" for c in ms)
            + "; pages "
            + " / ".join(f"{p:g}" for p in pages)
        )


if __name__ == "__main__":
    main()
