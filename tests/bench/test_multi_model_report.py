"""The multi-model benchmark's metrics and command line, without engines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.multimodel.report import (
    Slo,
    late_while_down,
    memory_demand,
    prism_slo,
    render_markdown,
    summarize,
    suspensions,
    swap_times,
)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_model.py"


def _row(i: int, model: str, ttft: float | None, tpot: float | None, error: str = "") -> dict[str, object]:
    ok = not error
    return {
        "id": i,
        "model": model,
        "arrival_s": float(i),
        "prompt_tokens": 10,
        "output_tokens": 100,
        "ok": ok,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "latency_s": None if not ok else (ttft or 0.0) + 99 * (tpot or 0.0),
        "completion_tokens": 100 if ok else 0,
        "error": error,
    }


def test_attainment_goodput_and_percentiles() -> None:
    rows = [
        _row(0, "a", 0.5, 0.02),  # attains
        _row(1, "a", 1.5, 0.02),  # TTFT too long
        _row(2, "b", 0.5, 0.06),  # TPOT too long
        _row(3, "b", 1.0, 0.05),  # both exactly at the targets: attains
        _row(4, "b", None, None, "HTTP 503: engine restarting"),
        _row(5, "c", None, None, "not served"),
        _row(6, "c", 2.0, 0.07),  # both too long
    ]
    m = summarize(rows, Slo(ttft_s=1.0, tpot_s=0.05), span_s=4.0)
    assert m["requests"] == 7 and m["completed"] == 5 and m["failed"] == 2
    assert m["slo_attainment"] == pytest.approx(2 / 7, abs=1e-4)
    assert m["misses"] == {"ttft": 1, "tpot": 1, "both": 1, "failed": 2}
    assert m["goodput_rps"] == pytest.approx(0.5) and m["goodput_tok_s"] == pytest.approx(50.0)
    assert m["errors"] == {"HTTP 503": 1, "not served": 1}
    assert m["served"] == ["a", "b", "c"] and m["models_served"] == 3
    assert m["ttft_p50_s"] == 1.0 and m["ttft_p99_s"] == 2.0
    assert m["tpot_p50_s"] == 0.05 and m["tpot_p99_s"] == 0.07
    assert m["makespan_s"] == pytest.approx(6 + 2.0 + 99 * 0.07, abs=0.01)


def test_no_completed_request_gives_zero_attainment_and_no_percentiles() -> None:
    m = summarize([_row(0, "a", None, None, "timeout after 5 s")], Slo(1.0, 0.1), span_s=1.0)
    assert m["slo_attainment"] == 0.0 and m["ttft_p50_s"] is None and m["throughput_tok_s"] == 0.0


def test_markdown_states_slo_and_curve() -> None:
    rows = [_row(0, "m0", 0.1, 0.01), _row(1, "m0", 3.0, 0.01), _row(2, "m0", 0.1, 0.2)]
    metrics = summarize(rows, Slo(1.0, 0.05), span_s=1.0)
    results = {
        "device": "cpu",
        "models": 2,
        "model_names": ["m0", "m1"],
        "trace": "a trace",
        "slo": Slo(1.0, 0.05).describe(),
        "setups": {
            "static": {"describe": "2 engines", "loads": {"1": {"metrics": metrics, "peak_kv_bytes": 2**20}}},
            "sleep": {"skipped": "elastic-kv serve is not installed"},
        },
    }
    text = render_markdown(results)
    assert "TTFT <= 1 s and TPOT <= 50 ms" in text
    assert "| static | 33.3 % |" in text and "1 of 2" in text
    assert "* static missed the SLO: 1 by TTFT only, 1 by TPOT only, 0 by both, 0 failed" in text
    assert "## SLO attainment by load" in text and "| 1 | 33.3 % | - |" in text
    assert "skipped: elastic-kv serve is not installed" in text


def test_prism_slo_per_model_and_swap_times() -> None:
    alone = {"ttft_p99_s": 0.2, "tpot_p99_s": 0.01}
    prism = prism_slo(alone, 5.0)
    assert prism == Slo(1.0, 0.05) and prism_slo(None, 5.0) is None
    rows = [_row(0, "a", 0.9, 0.04), _row(1, "a", 1.1, 0.04), _row(2, "b", None, None, "HTTP 503: x")]
    m = summarize(rows, Slo(10.0, 0.1), span_s=1.0, prism=prism)
    assert (m["slo_attainment"], m["prism_attainment"]) == (0.6667, 0.3333)  # rounded to 4 places
    assert m["per_model"]["a"] == {"requests": 2, "failed": 0, "slo_attainment": 1.0, "prism_attainment": 0.5}
    assert m["per_model"]["b"]["failed"] == 1
    status = {"models": [
        {"transitions": [{"kind": "start", "level": "cold", "seconds": 40.0},
                         {"kind": "sleep", "level": "1", "seconds": 0.4},
                         {"kind": "wake", "level": "1", "seconds": 0.9}]},
        {"transitions": [{"kind": "sleep", "level": "stop", "seconds": 2.0},
                         {"kind": "wake", "level": "cold", "seconds": 50.0},
                         {"kind": "suspend", "level": "1", "seconds": 0.3, "kept": 5,
                          "parked_bytes": 3 << 30},
                         {"kind": "resume", "level": "1", "seconds": 0.5},
                         {"kind": "suspend", "level": "1", "seconds": 0.2, "kept": 2, "parked_bytes": 0},
                         {"kind": "resume", "level": "1", "seconds": 0.5},
                         {"kind": "demote", "level": "2", "seconds": 0.01}]},
    ]}  # fmt: skip
    assert swap_times(status) == {"wake": [0.9], "resume": [0.5, 0.5], "cold": [40.0, 50.0], "sleep": [0.4],
                                  "suspend": [0.3, 0.2], "stop": [2.0], "demote": [0.01]}  # fmt: skip
    assert suspensions(status) == {"count": 2, "kept": 7, "parked": [3 << 30, 0], "unparked": 1}
    assert suspensions({"models": [{"transitions": []}]}) is None
    results = {
        "device": "cuda", "models": 2, "model_names": ["a", "b"], "trace": "t", "slo": "s",
        "prism_slo": prism.describe(),
        "setups": {"sleep": {"describe": "d", "final_status": status,
                             "loads": {"1": {"metrics": m, "peak_kv_bytes": 0}}}},
    }  # fmt: skip
    text = render_markdown(results)
    assert "| sleep | 66.7 % | 33.3 % |" in text and "| a | 2 | 100 / 50 % |" in text
    assert "| swap (wake from level 1/2, room made included) | 1 | 0.90 | 0.90 | 0.90 |" in text
    assert "Suspensions: 2, keeping 7 requests; KV parked in host memory 3.00 GiB in all" in text
    assert "; 1 kept requests but parked no KV" in text


def test_late_first_tokens_split_by_whether_their_model_was_down_while_they_waited() -> None:
    """Model ``a`` starts at 100 (on the wall clock), is suspended over 110-111 and resumed at 130, sleeps
    from 150 and never wakes; ``b`` never starts. The replay starts at 100 (arrivals are seconds since)."""
    status = {"models": [
        {"name": "a", "transitions": [
            {"kind": "start", "level": "cold", "seconds": 50.0, "at": 100.0},
            {"kind": "suspend", "level": "1", "seconds": 1.0, "at": 111.0},
            {"kind": "resume", "level": "1", "seconds": 0.5, "at": 130.0},
            {"kind": "demote", "level": "2", "seconds": 0.01, "at": 131.0},
            {"kind": "sleep", "level": "1", "seconds": 0.5, "at": 150.5}]},
        {"name": "b", "transitions": []},
    ]}  # fmt: skip
    waits = [  # model, arrival (s since 100), TTFT
        ("a", 0.0, 5.0),  # 100-105: in time
        ("a", 1.0, 12.0),  # 101-113: late, a suspended from 110
        ("a", 2.0, 12.0),  # 102-114: the same
        ("a", 3.0, 15.0),  # 103-118: the same
        ("a", 31.0, 9.0),  # 131-140: late, a awake throughout
        ("a", 31.0, 20.0),  # 131-151: late, a asleep from 150
        ("b", 0.0, 11.0),  # 100-111: late, b never started
    ]
    rows = [{**_row(i, m, ttft, 0.01), "arrival_s": t} for i, (m, t, ttft) in enumerate(waits)]
    rows.append(_row(7, "a", None, None, "HTTP 503: x"))  # failed: no first token to be late
    slo = Slo(ttft_s=8.0, tpot_s=0.05)
    assert late_while_down(rows, slo, status, start_epoch=100.0) == 5  # rows 1, 2, 3, 5, 6; not 4
    assert late_while_down(rows, slo, status, start_epoch=None) is None
    assert late_while_down(rows, slo, None, start_epoch=100.0) is None
    metrics = summarize(rows, slo, span_s=10.0)
    metrics["misses"]["ttft_while_down"] = 5
    results = {
        "device": "cuda", "models": 2, "model_names": ["a", "b"], "trace": "t", "slo": slo.describe(),
        "setups": {"sleep": {"describe": "d", "final_status": status,
                             "loads": {"4": {"metrics": metrics, "peak_kv_bytes": 0}}}},
    }  # fmt: skip
    assert (
        "* sleep missed the SLO: 6 by TTFT only, 0 by TPOT only, 0 by both, 1 failed; of the 6 first tokens "
        "late, 5 waited while their model was asleep or suspended, the others while it was awake throughout"
    ) in render_markdown(results)


def test_memory_demand_of_a_trace_served_as_it_arrives() -> None:
    # 10 output tokens at 1 s each; 100 B of weights a model, 1 B of KV a token. a0 (model a, 5 prompt
    # tokens) from 0 to 10 s, a1 (a, 5) from 2 s, b0 (b, 20) from 4 s: at 4 s a and b are in flight, KV
    # (5 + 4) + (5 + 2) + 20 = 36 tokens, 236 B; the peak is at 9.5 s: 2 x 100 + (14.5 + 12.5 + 25.5) B.
    rows = [_row(0, "a", 0.1, 1.0), _row(2, "a", 0.1, 1.0), _row(4, "b", 0.1, 1.0)]
    for row, prompt in zip(rows, (5, 5, 20), strict=True):
        row.update(output_tokens=10, prompt_tokens=prompt)
    demand = memory_demand(rows, model_bytes=100, kv_bytes_per_token=1, tpot_s=1.0, budget_bytes=230)
    assert demand["peak_bytes"] == 252
    # over 230 B from 4 s (236 B) until a1 ends at 12 s (at 11.5 s: 200 + 14.5 + 27.5 B); b0 arrives in it
    assert demand == {"peak_bytes": 252, "short_s": 8.0, "requests_short": 1}
    assert memory_demand(rows, 100, 1, 1.0, budget_bytes=300)["requests_short"] == 0

    results = {
        "device": "cuda", "models": 2, "model_names": ["a", "b"], "trace": "t", "slo": "s",
        "alone": {"tpot_p50_s": 1.0},
        "setups": {"sleep": {"describe": "d", "budget_bytes": 230, "model_bytes": 100,
                             "kv_bytes_per_token": 1,
                             "loads": {"1": {"metrics": summarize(rows, Slo(10.0, 2.0), span_s=5.0),
                                             "peak_kv_bytes": 0, "outcomes": rows}}}},
    }  # fmt: skip
    text = render_markdown(results)
    assert "sleep missed the SLO" not in text  # every request attained it
    assert "would need up to 252 B" in text and "budget of 230 B; it needs more for 8 s" in text, text
    assert "in which 1 of 3 requests arrive" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--setups", "static,bogus"], "--setups: unknown set-up 'bogus'"),
        (["--loads", "1,-2"], "loads must be > 0"),
        (["--prompt", "10:x"], "expected LO:HI tokens"),
        (["--serve-option", "kv_share_min_weights"], "expected KEY=VALUE (a TOML value)"),
    ],
)
def test_bad_arguments_stop_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert message in done.stderr.strip().splitlines()[-1]
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
