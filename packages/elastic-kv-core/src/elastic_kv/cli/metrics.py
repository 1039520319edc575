"""Prometheus metrics of every elastic-kv pool on this host, read from the shared-memory registry.

:class:`RegistryCollector` reads the records at scrape time, so it works in any process of the user --
vLLM's API server, SGLang's HTTP server, a sidecar -- not only in the process that owns the pools:

    from prometheus_client import REGISTRY
    from elastic_kv.cli.metrics import RegistryCollector
    REGISTRY.register(RegistryCollector())

or standalone: ``python -m elastic_kv.cli.metrics --port 9400`` (also ``kvctl metrics --port 9400``).

Metrics (labels ``pool, device, engine, model`` unless noted; ``*_bytes`` are physical bytes):

* ``elastic_kv_pool_limit_bytes`` (0 = unlimited), ``elastic_kv_pool_charged_bytes``;
* from the pool's last published snapshot: ``elastic_kv_pool_mapped_bytes``, ``..._reserved_bytes``,
  ``..._{used,free,available,total}_blocks``, ``..._{mapped,reserve,pending,draining}_pages``,
  ``elastic_kv_pool_largest_request_bytes``, ``elastic_kv_pool_reserve_{hits,misses}_total``,
  ``elastic_kv_pool_preemptions_total``, ``elastic_kv_pool_failed_requests_total``;
* ``elastic_kv_pool_page_latency_seconds`` histogram, label ``op`` = ``map`` | ``unmap``;
* ``elastic_kv_pool_info`` = 1 with ``pid`` and ``state``;
* per device (label ``device``): ``elastic_kv_device_budget_bytes`` (0 = unlimited),
  ``elastic_kv_device_charged_bytes``, ``elastic_kv_device_total_bytes`` (0 = unknown),
  ``elastic_kv_device_pools``.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from elastic_kv.errors import ConfigError
from elastic_kv.registry import DeviceInfo, PoolInfo, Registry

__all__ = ["RegistryCollector", "main", "serve"]

logger = logging.getLogger(__name__)

_POOL_LABELS = ("pool", "device", "engine", "model")

# (metric suffix, PoolSnapshot attribute, help text) of the gauges taken from a pool's last snapshot.
_SNAPSHOT_GAUGES = (
    ("mapped_bytes", "mapped_bytes", "Physical bytes backing the pool's mapped and in-flight pages."),
    ("used_blocks", "used_blocks", "Blocks issued to the engine (null block excluded)."),
    ("free_blocks", "free_blocks", "Logically free blocks."),
    ("available_blocks", "available_blocks", "Free blocks the pool could back now (logical and physical)."),
    ("total_blocks", "total_blocks", "Every block id the pool may issue."),
    ("mapped_pages", "mapped_pages", "Logical pages backed now."),
    ("reserve_pages", "reserve_pages", "Backed pages without live blocks kept to serve allocations."),
    ("pending_pages", "pending_pages", "Backed empty pages waiting for queued GPU work to finish."),
    ("draining_pages", "draining_pages", "Pages being released to meet a lowered limit (issue no block)."),
    (
        "largest_request_bytes",
        "largest_request_bytes",
        "Physical bytes the pool must hold for its largest unfinished request alone (0: no request).",
    ),
)


class RegistryCollector(Collector):
    """A Prometheus collector over every record of a registry (see the module docstring for the metrics).

    Args:
        registry: the registry to read; ``None`` = the default registry of this user
            (``RegistryConfig.from_env()``), opened at the first scrape.
    """

    def __init__(self, registry: Registry | None = None) -> None:
        self._registry = registry
        self._lock = threading.Lock()

    def _open(self) -> Registry:
        with self._lock:
            if self._registry is None:
                self._registry = Registry()
            return self._registry

    def describe(self) -> Iterable[Metric]:
        """Nothing: prometheus_client then skips its duplicate-name check instead of scraping at register."""
        return []

    def collect(self) -> Iterator[Metric]:
        """One scrape: reclaims dead owners, then reads every pool and device record."""
        registry = self._open()
        pools = registry.pools()
        devices = registry.devices(reclaim=False)
        yield from _pool_metrics(pools)
        yield from _device_metrics(devices)


def _pool_metrics(pools: Sequence[PoolInfo]) -> Iterator[Metric]:
    def gauge(suffix: str, doc: str, extra: Sequence[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"elastic_kv_pool_{suffix}", doc, labels=[*_POOL_LABELS, *extra])

    limit = gauge("limit_bytes", "Physical limit of the pool (0 = unlimited).")
    charged = gauge("charged_bytes", "Physical bytes the pool has charged against its limit and budget.")
    reserved = gauge("reserved_bytes", "Physical bytes of backed pages without live blocks.")
    info = gauge("info", "Constant 1 per live pool: owner pid and state.", ("pid", "state"))
    snap = {suffix: gauge(suffix, doc) for suffix, _, doc in _SNAPSHOT_GAUGES}
    hits = CounterMetricFamily(
        "elastic_kv_pool_reserve_hits",
        "Pages served from the reserve without a driver call.",
        labels=_POOL_LABELS,
    )
    misses = CounterMetricFamily(
        "elastic_kv_pool_reserve_misses",
        "Pages mapped synchronously on the allocating thread.",
        labels=_POOL_LABELS,
    )
    preemptions = CounterMetricFamily(
        "elastic_kv_pool_preemptions",
        "Requests the engine preempted (to recompute later), to meet a limit or for want of memory.",
        labels=_POOL_LABELS,
    )
    failed = CounterMetricFamily(
        "elastic_kv_pool_failed_requests",
        "Requests the engine ended with an error: they need more than the pool's limit or budget allows.",
        labels=_POOL_LABELS,
    )
    latency = HistogramMetricFamily(
        "elastic_kv_pool_page_latency_seconds",
        "Latency of page map/unmap operations of the pool.",
        labels=[*_POOL_LABELS, "op"],
    )
    for pool in pools:
        labels = [pool.name, pool.device, pool.engine, pool.model]
        limit.add_metric(labels, pool.limit_bytes)
        charged.add_metric(labels, pool.charged_bytes)
        state = "unpublished" if pool.snapshot is None else pool.snapshot.state.value
        info.add_metric([*labels, str(pool.pid), state], 1)
        if pool.snapshot is not None:
            reserved.add_metric(labels, pool.reserved_bytes)
            for suffix, attribute, _ in _SNAPSHOT_GAUGES:
                snap[suffix].add_metric(labels, getattr(pool.snapshot, attribute))
            hits.add_metric(labels, pool.snapshot.reserve_hits)
            misses.add_metric(labels, pool.snapshot.reserve_misses)
            preemptions.add_metric(labels, pool.snapshot.preemptions)
            failed.add_metric(labels, pool.snapshot.failed_requests)
        for histogram in pool.latency:
            cumulative = 0
            buckets = []
            for bound, count in zip((*histogram.bounds, math.inf), histogram.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if math.isinf(bound) else repr(bound), float(cumulative)))
            latency.add_metric([*labels, histogram.op], buckets, histogram.sum_seconds)
    yield from (limit, charged, reserved, info, *snap.values(), hits, misses, preemptions, failed, latency)


def _device_metrics(devices: Sequence[DeviceInfo]) -> Iterator[Metric]:
    budget = GaugeMetricFamily(
        "elastic_kv_device_budget_bytes", "GPU-wide budget (0 = unlimited).", labels=["device"]
    )
    charged = GaugeMetricFamily(
        "elastic_kv_device_charged_bytes", "Sum of every pool's charge on the device.", labels=["device"]
    )
    total = GaugeMetricFamily(
        "elastic_kv_device_total_bytes",
        "Device memory as a pool reported it (0 = unknown).",
        labels=["device"],
    )
    count = GaugeMetricFamily("elastic_kv_device_pools", "Pools registered on the device.", labels=["device"])
    for device in devices:
        budget.add_metric([device.device], device.budget_bytes)
        charged.add_metric([device.device], device.charged_bytes)
        total.add_metric([device.device], device.total_bytes)
        count.add_metric([device.device], len(device.pools))
    yield from (budget, charged, total, count)


def serve(port: int, addr: str = "127.0.0.1", registry: Registry | None = None) -> None:
    """Serve ``/metrics`` for every pool of ``registry`` on ``addr:port`` until SIGINT or SIGTERM.

    Binds to localhost by default: the metrics name models and PIDs. Pass ``addr="0.0.0.0"`` to expose
    them to a remote Prometheus.
    """
    collectors = CollectorRegistry(auto_describe=False)
    collectors.register(RegistryCollector(registry))
    server, thread = start_http_server(port, addr, registry=collectors)
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # Signal handlers can only be installed from the main thread; elsewhere the caller stops the process.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None
    logger.info("serving elastic-kv metrics on http://%s:%d/metrics", addr, server.server_port)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        server.shutdown()
        thread.join()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elastic_kv.cli.metrics --port N [--addr A] [--registry-dir D]``."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_kv.cli.metrics", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port to serve /metrics on")
    parser.add_argument("--addr", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--registry-dir", type=Path, default=None, help="registry directory (default: per user)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        registry = Registry(args.registry_dir)
    except ConfigError as exc:
        logger.error("elastic_kv.cli.metrics: %s", exc)
        return 4  # as kvctl: the registry directory cannot be used
    serve(args.port, args.addr, registry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
