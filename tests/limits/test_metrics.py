"""Prometheus exposition of pools owned by *other* processes, parsed back with prometheus_client's parser."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic_kv.cli.metrics import RegistryCollector
from elastic_kv.registry import Registry
from elastic_kv.registry.layout import HISTOGRAM_BOUNDS
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from limits.helpers import PoolProcess

MiB = 1 << 20
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by (sample name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def scrape(registry_dir: Path) -> Samples:
    collectors = CollectorRegistry(auto_describe=True)
    collectors.register(RegistryCollector(Registry(registry_dir)))
    return parse(generate_latest(collectors).decode())


@pytest.fixture
def busy_pool(registry_dir: Path, spawn_pool: Callable[..., PoolProcess]) -> PoolProcess:
    Registry(registry_dir).set_budget("cuda:0", 512 * MiB)
    pool = spawn_pool("llama", limit=256 * MiB, engine="vllm", model="meta-llama/Llama-3.1-8B", total=1 << 30)
    assert pool.send(f"charge {96 * MiB}")["ok"]
    assert pool.send(f"publish 700 4096 {96 * MiB} 90 10 3 {6 * MiB} 2")["ok"]
    for seconds in (3e-5, 3e-5, 4e-4, 2.0):
        assert pool.send(f"observe map {seconds}")["ok"]
    assert pool.send("observe unmap 1e-5")["ok"]
    return pool


def test_collector_exports_another_process_pools(registry_dir: Path, busy_pool: PoolProcess) -> None:
    samples = scrape(registry_dir)
    pool = {"pool": "llama", "device": "cuda:0", "engine": "vllm", "model": "meta-llama/Llama-3.1-8B"}
    assert value(samples, "elastic_kv_pool_limit_bytes", **pool) == 256 * MiB
    assert value(samples, "elastic_kv_pool_charged_bytes", **pool) == 96 * MiB
    assert value(samples, "elastic_kv_pool_mapped_bytes", **pool) == 96 * MiB
    assert value(samples, "elastic_kv_pool_reserved_bytes", **pool) == 2 * MiB  # 1 reserve page of 2 MiB
    assert value(samples, "elastic_kv_pool_used_blocks", **pool) == 700
    assert value(samples, "elastic_kv_pool_total_blocks", **pool) == 4096
    assert value(samples, "elastic_kv_pool_reserve_hits_total", **pool) == 90
    assert value(samples, "elastic_kv_pool_reserve_misses_total", **pool) == 10
    assert value(samples, "elastic_kv_pool_preemptions_total", **pool) == 3
    assert value(samples, "elastic_kv_pool_draining_pages", **pool) == 0
    assert value(samples, "elastic_kv_pool_largest_request_bytes", **pool) == 6 * MiB
    assert value(samples, "elastic_kv_pool_failed_requests_total", **pool) == 2
    assert value(samples, "elastic_kv_pool_info", pool="llama", pid=str(busy_pool.pid), state="active") == 1
    # Histograms: cumulative buckets, +Inf == count, sum of the samples sent.
    name = "elastic_kv_pool_page_latency_seconds"
    assert value(samples, f"{name}_count", op="map", **pool) == 4
    assert value(samples, f"{name}_sum", op="map", **pool) == pytest.approx(2.00046)
    assert value(samples, f"{name}_bucket", op="map", le="5e-05", **pool) == 2
    assert value(samples, f"{name}_bucket", op="map", le="0.0005", **pool) == 3
    assert value(samples, f"{name}_bucket", op="map", le="1.0", **pool) == 3
    assert value(samples, f"{name}_bucket", op="map", le="+Inf", **pool) == 4
    assert value(samples, f"{name}_count", op="unmap", **pool) == 1
    buckets = [v for (n, ls), v in samples.items() if n == f"{name}_bucket" and ("op", "map") in ls]
    assert len(buckets) == len(HISTOGRAM_BOUNDS) + 1
    # Device metrics.
    assert value(samples, "elastic_kv_device_budget_bytes", device="cuda:0") == 512 * MiB
    assert value(samples, "elastic_kv_device_charged_bytes", device="cuda:0") == 96 * MiB
    assert value(samples, "elastic_kv_device_total_bytes", device="cuda:0") == 1 << 30
    assert value(samples, "elastic_kv_device_pools", device="cuda:0") == 1


def test_unpublished_pool_exports_only_what_its_record_knows(
    registry_dir: Path, spawn_pool: Callable[..., PoolProcess]
) -> None:
    spawn_pool("fresh", limit=MiB)
    samples = scrape(registry_dir)
    assert value(samples, "elastic_kv_pool_limit_bytes", pool="fresh") == MiB
    assert value(samples, "elastic_kv_pool_info", pool="fresh", state="unpublished") == 1
    assert not [k for k in samples if k[0] == "elastic_kv_pool_used_blocks"]


def test_dead_owner_disappears_from_metrics(registry_dir: Path, busy_pool: PoolProcess) -> None:
    busy_pool.kill(signal.SIGKILL)
    samples = scrape(registry_dir)
    assert not [k for k in samples if k[0].startswith("elastic_kv_pool_")]
    assert value(samples, "elastic_kv_device_charged_bytes", device="cuda:0") == 0


def test_kvctl_metrics_prints_the_exposition(
    kvctl: Callable[..., subprocess.CompletedProcess[str]], busy_pool: PoolProcess
) -> None:
    done = kvctl("metrics")
    assert done.returncode == 0, done.stderr
    assert value(parse(done.stdout), "elastic_kv_pool_charged_bytes", pool="llama") == 96 * MiB


def test_standalone_server(child_env: dict[str, str], busy_pool: PoolProcess) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "elastic_kv.cli.metrics", "--port", "0"],
        env=child_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        lines: list[str] = []
        match = None
        while match is None and len(lines) < 50:  # tolerate warnings printed before the address
            lines.append(server.stderr.readline())
            match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", lines[-1])
        assert match, lines
        with urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/metrics", timeout=10) as response:
            samples = parse(response.read().decode())
        assert value(samples, "elastic_kv_pool_used_blocks", pool="llama") == 700
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stderr is not None:
            server.stderr.close()


def test_standalone_server_refuses_an_unusable_registry(tmp_path: Path, child_env: dict[str, str]) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv.cli.metrics", "--port", "0", "--registry-dir", str(loose)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 4
    assert "chmod 700" in done.stderr and "Traceback" not in done.stderr
