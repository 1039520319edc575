"""Throughput of the GPU proof, elastic / native, on bursts from idle: both engines stay up, and each round
runs the same burst on one engine, then the other (alternating which goes first), while the other idles, so
that the machine's drift hits both alike; the ratio is the median over rounds."""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

from benchmarks.gpu_vllm.protocol import Engine

logger = logging.getLogger("gpu_vllm")


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], list[tuple[float, float]]]:
    """Start both engines, run ``args.bursts`` rounds, and return (native report, elastic report, rounds:
    (native, elastic) tokens per second each). Under ``--calibrate`` both slots run one backend: "elastic"
    is then slot A, "native" slot B."""
    elastic_engine, native_engine = _start(args)
    rounds = _rounds(elastic_engine, native_engine, args.bursts)
    elastic, native = elastic_engine.finish(), native_engine.finish()
    elastic_engine.close()
    native_engine.close()
    return native, elastic, rounds


def _start(args: argparse.Namespace) -> tuple[Engine, Engine]:
    """Both engines, ready: (elastic, native)."""
    # Slot A starts first (elastic, unless --swap): with --shared-caches, what the first engine compiles
    # shortens the second's start-up.
    first, second = Engine("A", args), Engine("B", args)
    return (second, first) if args.swap else (first, second)


def _rounds(elastic_engine: Engine, native_engine: Engine, bursts: int) -> list[tuple[float, float]]:
    """(native, elastic) tokens per second of each round, logged as it goes."""
    rounds: list[tuple[float, float]] = []
    for r in range(bursts):
        # Both engines are up; one bursts while the other idles. Alternating which goes first, each round's
        # pair runs back to back on the same prompts, so the machine's drift hits both alike.
        if r % 2:
            e, n = elastic_engine.burst(2 + r), native_engine.burst(2 + r)
        else:
            n, e = native_engine.burst(2 + r), elastic_engine.burst(2 + r)
        rounds.append((n, e))
        # As it goes: a run cut short by a time limit still says how far it got.
        logger.info(
            "round %d/%d: native %.0f tok/s, elastic %.0f tok/s, ratio %.4f", r + 1, bursts, n, e, e / n
        )
    return rounds


def ratios(rounds: list[tuple[float, float]]) -> list[float]:
    """Elastic / native, round by round."""
    return [e / n for n, e in rounds]


def spread(ratios: list[float]) -> float:
    """The spread of the rounds, as a 95 % interval of their mean (normal approximation): a ratio goal
    closer to the median than this is within the machine's noise. NaN for a single round."""
    return 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
