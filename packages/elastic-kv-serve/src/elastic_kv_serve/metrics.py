"""Prometheus metrics of the server (prometheus-client, one private registry per server).

Event metrics (recorded as they happen)::

    elastic_kv_serve_requests_total{model,endpoint,code}       requests answered
    elastic_kv_serve_request_seconds{model,endpoint}           request latency (histogram)
    elastic_kv_serve_wake_seconds{model,mode,level}            wake latency, request waiting (histogram;
                                                               level 1, 2 or cold)
    elastic_kv_serve_sleep_seconds{model,level}                sleep latency (histogram; level 1, 2, stop)
    elastic_kv_serve_restarts_total{model}                     engine restarts after a failure

State metrics (read from the server's :class:`elastic_kv_serve.fleet.Fleet` at each scrape)::

    elastic_kv_serve_model_state{model,state}                  1 for the model's current state
    elastic_kv_serve_model_in_flight{model}                    requests being served
    elastic_kv_serve_model_queued{model}                       requests waiting for the model to wake
    elastic_kv_serve_model_weights_bytes{model}                weights (counted while awake)
    elastic_kv_serve_model_kv_bytes{model}                     KV backed now (the pool records)
    elastic_kv_serve_model_host_bytes{model}                   host memory its asleep weights take
    elastic_kv_serve_model_wakes_total{model}                  wakes on demand
    elastic_kv_serve_model_sleeps_total{model}                 sleeps (idle, to make room, or suspended)
    elastic_kv_serve_model_suspends_total{model}               sleeps while serving (requests kept)
    elastic_kv_serve_model_suspended{model}                    1 while suspended
    elastic_kv_serve_budget_bytes / elastic_kv_serve_used_bytes    the budget and what awake models use
    elastic_kv_serve_host_budget_bytes / _host_used_bytes      the host budget and what asleep weights use

For routers that pick a server by vLLM's metrics (the Gateway API inference extension's model-server
protocol, llm-d), the same state under vLLM's names, one series per model (``model_name``, as vLLM labels
them)::

    vllm:num_requests_waiting{model_name}      requests waiting at the server (to wake, start, or for a slot)
    vllm:num_requests_running{model_name}      requests being served
    vllm:kv_cache_usage_perc{model_name}       the part of the device budget in use (awake weights and every
                                               model's KV, 0 to 1; 0 without a budget): the same for every
                                               model, since they share it
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elastic_kv_serve.runtime import State

if TYPE_CHECKING:
    from elastic_kv_serve.fleet import Fleet

__all__ = ["ServeMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_WAKE_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class _StateCollector(Collector):
    def __init__(self) -> None:
        self.fleet: Fleet | None = None

    def collect(self) -> Iterator[Metric]:
        fleet = self.fleet
        if fleet is None:
            return
        state = GaugeMetricFamily(
            "elastic_kv_serve_model_state", "1 for the model's state", labels=["model", "state"]
        )
        gauges = {
            key: GaugeMetricFamily(f"elastic_kv_serve_model_{key}", help_, labels=["model"])
            for key, help_ in (
                ("in_flight", "requests being served"),
                ("queued", "requests waiting for the model to wake"),
                ("weights_bytes", "weights of the model"),
                ("kv_bytes", "KV cache bytes backed now"),
                ("host_bytes", "host memory the asleep weights take"),
                ("suspended", "1 while asleep with its requests kept in its engine"),
            )
        }
        counters = {
            key: CounterMetricFamily(f"elastic_kv_serve_model_{key}", help_, labels=["model"])
            for key, help_ in (
                ("wakes", "wakes on demand"),
                ("sleeps", "sleeps"),
                ("suspends", "sleeps while serving, its requests kept"),
            )
        }
        for rt in fleet.models.values():
            for s in State:
                state.add_metric([rt.name, s.value], 1.0 if rt.state is s else 0.0)
            gauges["in_flight"].add_metric([rt.name], rt.in_flight)
            gauges["queued"].add_metric([rt.name], rt.queued)
            gauges["weights_bytes"].add_metric([rt.name], rt.weights_bytes)
            gauges["kv_bytes"].add_metric([rt.name], rt.kv_bytes)
            gauges["host_bytes"].add_metric([rt.name], rt.host_bytes)
            gauges["suspended"].add_metric([rt.name], 1.0 if rt.suspended else 0.0)
            counters["wakes"].add_metric([rt.name], rt.wakes)
            counters["sleeps"].add_metric([rt.name], rt.sleeps)
            counters["suspends"].add_metric([rt.name], rt.suspends)
        yield state
        yield from gauges.values()
        yield from counters.values()
        budget = GaugeMetricFamily("elastic_kv_serve_budget_bytes", "device budget of the models (0 = none)")
        budget.add_metric([], fleet.budget_bytes or 0)
        yield budget
        used = GaugeMetricFamily("elastic_kv_serve_used_bytes", "awake weights plus every model's KV")
        used.add_metric([], fleet.used_bytes())
        yield used
        host_budget = GaugeMetricFamily(
            "elastic_kv_serve_host_budget_bytes", "host memory for asleep weights"
        )
        host_budget.add_metric([], fleet.host.budget_bytes)
        yield host_budget
        host_used = GaugeMetricFamily("elastic_kv_serve_host_used_bytes", "host memory asleep weights take")
        host_used.add_metric([], fleet.host_used_bytes())
        yield host_used
        yield from _router_metrics(fleet)


def _router_metrics(fleet: Fleet) -> Iterator[Metric]:
    """The state routers read, under vLLM's metric names (see the module docstring)."""
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "requests waiting", labels=["model_name"])
    running = GaugeMetricFamily("vllm:num_requests_running", "requests being served", labels=["model_name"])
    usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "part of the device budget in use (0 to 1)", labels=["model_name"]
    )
    used = fleet.used_bytes() / fleet.budget_bytes if fleet.budget_bytes else 0.0
    for rt in fleet.models.values():
        waiting.add_metric([rt.name], rt.queued)
        running.add_metric([rt.name], rt.in_flight)
        usage.add_metric([rt.name], min(1.0, used))
    yield from (waiting, running, usage)


class ServeMetrics:
    """The server's metrics in their own :class:`CollectorRegistry` (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "elastic_kv_serve_requests",
            "requests answered",
            ["model", "endpoint", "code"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "elastic_kv_serve_request_seconds",
            "request latency, admission to the last byte",
            ["model", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.wake_seconds = Histogram(
            "elastic_kv_serve_wake_seconds",
            "time from a wake's start to the model serving",
            ["model", "mode", "level"],
            buckets=_WAKE_BUCKETS,
            registry=self.registry,
        )
        self.sleep_seconds = Histogram(
            "elastic_kv_serve_sleep_seconds",
            "time from a sleep's start to the model asleep",
            ["model", "level"],
            buckets=_WAKE_BUCKETS,
            registry=self.registry,
        )
        self.restarts = Counter(
            "elastic_kv_serve_restarts", "engine restarts after a failure", ["model"], registry=self.registry
        )
        self._state = _StateCollector()
        self.registry.register(self._state)

    def bind(self, fleet: Fleet) -> None:
        """Read state metrics from ``fleet`` at each scrape."""
        self._state.fleet = fleet

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
