"""The multi-model benchmark's trace generator: seeded, bursty (CV >= 2), Zipf-popular, stated lengths."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.multimodel.trace import TraceSpec, build_trace, prompt_token_ids, zipf_weights

SPEC = TraceSpec(
    models=4, bursts=40, burst_size=5, burst_spread_s=0.5, prompt=(10, 30), output=(20, 60), cv=3.0, seed=7
)


def _cv(x: np.ndarray) -> float:
    return float(np.std(x) / np.mean(x))


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a, b = build_trace(SPEC, 2.0), build_trace(SPEC, 2.0)
    assert a.requests == b.requests and a.burst_starts == b.burst_starts
    c = build_trace(dataclasses.replace(SPEC, seed=8), 2.0)
    assert [r.model for r in c.requests] != [r.model for r in a.requests]
    first = a.requests[3]
    assert prompt_token_ids(SPEC, first, 1024) == prompt_token_ids(SPEC, first, 1024)
    assert prompt_token_ids(SPEC, first, 1024) != prompt_token_ids(SPEC, a.requests[4], 1024)


def test_every_load_replays_the_same_bursts_closer_together() -> None:
    slow, fast = build_trace(SPEC, 1.0), build_trace(SPEC, 4.0)
    assert slow.burst_models == fast.burst_models
    assert sorted((r.burst, r.prompt_tokens, r.output_tokens) for r in slow.requests) == sorted(
        (r.burst, r.prompt_tokens, r.output_tokens) for r in fast.requests
    )
    np.testing.assert_allclose(np.array(slow.burst_starts), 4.0 * np.array(fast.burst_starts))
    # The offered load is the nominal one: bursts x size / span.
    for trace in (slow, fast):
        assert len(trace.requests) == SPEC.bursts * SPEC.burst_size
        assert len(trace.requests) / trace.span_s == pytest.approx(trace.load)
        gaps = np.diff(np.array([*trace.burst_starts, trace.span_s]))
        assert gaps.mean() == pytest.approx(SPEC.burst_size / trace.load)


def test_arrivals_are_bursty_with_the_stated_cv() -> None:
    spec = dataclasses.replace(SPEC, bursts=20000, burst_size=1, burst_spread_s=0.0, cv=2.5)
    trace = build_trace(spec, 1.0)
    gaps = np.diff(np.array(trace.burst_starts))
    assert _cv(gaps) == pytest.approx(2.5, rel=0.1)
    # Requests as a client sees them (bursts of several, spread over half a second) are burstier still.
    trace = build_trace(dataclasses.replace(SPEC, bursts=2000), 1.0)
    arrivals = np.array([r.arrival_s for r in trace.requests])
    assert _cv(np.diff(arrivals)) >= 2.0
    assert np.all(np.diff(arrivals) >= 0)


def test_model_popularity_follows_zipf() -> None:
    spec = dataclasses.replace(SPEC, models=5, bursts=20000, burst_size=1, zipf_s=1.2)
    counts = np.bincount(build_trace(spec, 1.0).burst_models, minlength=5)
    expected = zipf_weights(5, 1.2)
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.015)
    assert list(counts) == sorted(counts, reverse=True)
    # log(count) falls linearly in log(rank) with slope -s
    slope = np.polyfit(np.log(np.arange(1, 6)), np.log(counts), 1)[0]
    assert slope == pytest.approx(-1.2, abs=0.1)
    np.testing.assert_allclose(zipf_weights(3, 0.0), [1 / 3] * 3)


def test_lengths_and_prompts_stay_in_their_stated_ranges() -> None:
    trace = build_trace(dataclasses.replace(SPEC, bursts=400), 3.0)
    prompts = np.array([r.prompt_tokens for r in trace.requests])
    outputs = np.array([r.output_tokens for r in trace.requests])
    assert prompts.min() == 10 and prompts.max() == 30  # both ends inclusive, uniformly drawn
    assert outputs.min() == 20 and outputs.max() == 60
    assert abs(prompts.mean() - 20) < 1 and abs(outputs.mean() - 40) < 2
    ids = prompt_token_ids(SPEC, trace.requests[0], 100)
    assert len(ids) == trace.requests[0].prompt_tokens and min(ids) >= 16 and max(ids) < 100
    # Each burst's requests go to one model and arrive within the spread after the burst's start.
    for r in trace.requests:
        assert r.model == trace.burst_models[r.burst]
        assert 0 <= r.arrival_s - trace.burst_starts[r.burst] <= SPEC.burst_spread_s


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("models", 0),
        ("bursts", 0),
        ("prompt", (5, 4)),
        ("output", (0, 3)),
        ("cv", 0.0),
        ("burst_spread_s", -1),
    ],
)
def test_bad_specs_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"trace: bad {field}"):
        dataclasses.replace(SPEC, **{field: value})  # type: ignore[arg-type]


def test_bad_load_is_refused() -> None:
    with pytest.raises(ValueError, match="load must be > 0"):
        build_trace(SPEC, 0.0)


def test_cover_gives_every_model_a_burst_and_keeps_the_rest_of_the_draw() -> None:
    spec = dataclasses.replace(SPEC, models=12, bursts=16, seed=3)
    plain = build_trace(spec, 2.0).burst_models
    assert len(set(plain)) < 12  # Zipf over 12 models in 16 bursts misses some
    covered = build_trace(dataclasses.replace(spec, cover=True), 2.0)
    assert sorted(set(covered.burst_models)) == list(range(12))
    changed = [i for i, (a, b) in enumerate(zip(plain, covered.burst_models, strict=True)) if a != b]
    assert len(changed) == 12 - len(set(plain))  # one burst moved per model the draw missed
    assert covered.burst_starts == build_trace(spec, 2.0).burst_starts  # same times, same lengths
    with pytest.raises(ValueError, match="cover"):
        dataclasses.replace(SPEC, models=5, bursts=4, cover=True)
