"""The seeded multi-model trace: bursts of requests, each burst to one model, with heavy-tailed gaps.

A trace is ``bursts`` bursts. Burst ``j`` goes to one model, drawn from a Zipf popularity
(``p_i`` proportional to ``1 / (i + 1) ** zipf_s``, model 0 the most popular), and has ``burst_size``
requests whose arrivals are spread uniformly over ``burst_spread_s`` seconds after the burst starts. The
gaps between burst starts are gamma-distributed with coefficient of variation ``cv`` (shape ``1 / cv**2``):
with ``cv >= 2`` most gaps are short and a few are very long, so one model's burst often runs while its
neighbours idle, and sometimes bursts to several models pile up. Each request's prompt and output lengths
are drawn uniformly from the inclusive ranges ``prompt`` and ``output``; outputs are forced to their
length (``ignore_eos``), so every request does exactly the work the trace states. With ``cover`` (and at
least as many bursts as models) every model gets a burst: for each model the draw missed, in model order, the
last burst of the model drawn most often goes to it instead -- so a trace of many models reaches every one,
and a set-up's "models served" counts models that were asked for.

The load is the mean request rate. The gaps are rescaled so that their mean is exactly
``burst_size / load``: every load replays the same bursts (same models, same lengths, same order), only
closer together, and the offered load of a replay equals its nominal load. The first burst starts at 0.

Everything is drawn from ``numpy.random.default_rng(seed)`` in a fixed order, so one seed gives one trace
on every machine; prompt token ids come from a generator seeded with ``(seed, request id)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["Request", "Trace", "TraceSpec", "build_trace", "prompt_token_ids", "zipf_weights"]


@dataclass(frozen=True)
class TraceSpec:
    """What a trace is drawn from (see the module docstring)."""

    models: int
    bursts: int
    burst_size: int
    burst_spread_s: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    cv: float = 3.0
    zipf_s: float = 1.0
    seed: int = 0
    cover: bool = False

    def __post_init__(self) -> None:
        checks = {
            "models": self.models >= 1,
            "bursts": self.bursts >= 1,
            "burst_size": self.burst_size >= 1,
            "burst_spread_s": self.burst_spread_s >= 0,
            "prompt": 1 <= self.prompt[0] <= self.prompt[1],
            "output": 1 <= self.output[0] <= self.output[1],
            "cv": self.cv > 0,
            "zipf_s": self.zipf_s >= 0,
            "cover": not self.cover or self.bursts >= self.models,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"trace: bad {bad[0]}: {getattr(self, bad[0])!r}")

    def describe(self) -> str:
        """One line that states the distributions (printed with every report)."""
        return (
            f"{self.bursts} bursts x {self.burst_size} requests (arrivals uniform over "
            f"{self.burst_spread_s:g} s), gamma gaps between bursts with CV {self.cv:g}, one model per burst "
            f"from Zipf(s={self.zipf_s:g}) over {self.models} models, prompt tokens uniform "
            f"[{self.prompt[0]}, {self.prompt[1]}], output tokens uniform [{self.output[0]}, "
            f"{self.output[1]}] (ignore_eos), seed {self.seed}"
            + (", every model drawn at least once" if self.cover else "")
        )


@dataclass(frozen=True)
class Request:
    """One request of a trace: ``arrival_s`` after the replay starts, to model index ``model``."""

    id: int
    burst: int
    arrival_s: float
    model: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    """The requests of one replay, sorted by arrival, and the load they were placed at."""

    spec: TraceSpec
    load: float
    requests: tuple[Request, ...]
    burst_starts: tuple[float, ...]
    burst_models: tuple[int, ...]

    @property
    def duration_s(self) -> float:
        """From the first arrival (0) to the last."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def span_s(self) -> float:
        """The time the offered load is measured over: bursts times the mean gap between them."""
        return self.spec.bursts * self.spec.burst_size / self.load

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the spec, the load and the per-burst schedule (requests are rebuilt from the seed)."""
        return {
            "spec": asdict(self.spec),
            "load_rps": self.load,
            "requests": len(self.requests),
            "span_s": round(self.span_s, 3),
            "burst_starts_s": [round(t, 3) for t in self.burst_starts],
            "burst_models": list(self.burst_models),
        }


def zipf_weights(models: int, s: float) -> np.ndarray:
    """Popularity of models ``0..models-1``: ``1 / (i + 1) ** s``, normalised to sum 1."""
    w = 1.0 / np.arange(1, models + 1, dtype=np.float64) ** s
    return w / w.sum()


def _cover(models: np.ndarray, n: int) -> np.ndarray:
    """``models`` with every index ``0..n-1`` present (see the module docstring); deterministic."""
    out = models.copy()
    for missing in range(n):
        if missing in out:
            continue
        counts = np.bincount(out, minlength=n)
        donor = int(np.argmax(counts))  # the most drawn (lowest index on a tie)
        out[np.flatnonzero(out == donor)[-1]] = missing
    return out


def _unit_gaps(rng: np.random.Generator, n: int, cv: float) -> np.ndarray:
    """``n`` gamma gaps with coefficient of variation ``cv``, rescaled to mean exactly 1."""
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / shape, size=n)
    total = gaps.sum()
    return gaps * (n / total) if total > 0 else np.ones(n)


def build_trace(spec: TraceSpec, load: float) -> Trace:
    """The replay of ``spec`` at ``load`` requests per second (same seed, same bursts at every load)."""
    if not load > 0:
        raise ValueError(f"trace: load must be > 0 requests/s, got {load!r}")
    rng = np.random.default_rng(spec.seed)
    # Draw order is fixed: gaps, burst models, then per request offset, prompt and output lengths.
    gaps = _unit_gaps(rng, spec.bursts, spec.cv) * (spec.burst_size / load)
    starts = np.concatenate(([0.0], np.cumsum(gaps)[:-1]))
    models = rng.choice(spec.models, size=spec.bursts, p=zipf_weights(spec.models, spec.zipf_s))
    if spec.cover:
        models = _cover(models, spec.models)
    n = spec.bursts * spec.burst_size
    offsets = rng.uniform(0.0, spec.burst_spread_s, size=n) if spec.burst_spread_s > 0 else np.zeros(n)
    prompts = rng.integers(spec.prompt[0], spec.prompt[1] + 1, size=n)
    outputs = rng.integers(spec.output[0], spec.output[1] + 1, size=n)
    rows = []
    for i in range(n):
        burst = i // spec.burst_size
        rows.append(
            (float(starts[burst] + offsets[i]), burst, int(models[burst]), int(prompts[i]), int(outputs[i]))
        )
    rows.sort(key=lambda r: (r[0], r[1]))
    requests = tuple(
        Request(id=k, burst=b, arrival_s=t, model=m, prompt_tokens=p, output_tokens=o)
        for k, (t, b, m, p, o) in enumerate(rows)
    )
    return Trace(
        spec=spec,
        load=load,
        requests=requests,
        burst_starts=tuple(float(t) for t in starts),
        burst_models=tuple(int(m) for m in models),
    )


def prompt_token_ids(spec: TraceSpec, request: Request, vocab_size: int) -> list[int]:
    """The prompt of ``request``: ``prompt_tokens`` ids in ``[16, vocab_size)``, fixed by (seed, id).

    Random ids give every request its own prefix, so prefix caching saves nothing and KV use is exactly
    prompt + output tokens. Ids below 16 are left out: tokenizers keep their special tokens there.
    """
    if vocab_size <= 16:
        raise ValueError(f"vocab_size must be > 16, got {vocab_size}")
    rng = np.random.default_rng([spec.seed, request.id])
    return [int(x) for x in rng.integers(16, vocab_size, size=request.prompt_tokens)]
