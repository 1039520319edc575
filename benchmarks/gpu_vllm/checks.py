"""The GPU proof's checks: what must hold for exit status 0 (the report prints each: ``ok`` or ``FAILED``)."""

from __future__ import annotations

from typing import Any

SPEED_GOAL = 0.99  # throughput elastic / native, the median of the rounds


def evaluate(
    native: dict[str, Any], elastic: dict[str, Any], ratio: float, speed_goal: bool
) -> dict[str, bool]:
    """Each check by name, from the engines' reports and the median throughput ratio (checked only with
    ``speed_goal``: not under ``--no-speed-goal``)."""
    # Idle, the pool backs the null block's page and its minimum reserve, nothing more.
    idle_ok = elastic["charged_after"] <= elastic["page_bytes"] + elastic["reserve_min_bytes"]
    steady = elastic["steady_decode"]
    checks = {
        "greedy outputs equal": native["tokens"] == elastic["tokens"],
        "idle footprint <= null page + minimum reserve": idle_ok,
        "no driver call in steady decode": steady["steps"] > 0 and steady["driver_steps"] == 0,
    }
    if speed_goal:
        checks[f"throughput ratio >= {SPEED_GOAL}"] = ratio >= SPEED_GOAL
    return checks
