"""``benchmarks/multi_model.py --device cpu`` end to end on a small fixed trace: real vLLM engines on the CPU.

Two tiny models, three bursts of four requests (seed 7: to m0 at 0 s, m1 at 0.75 s and 6 s). The KV total
(1.5 MiB) holds only one static engine of ``--max-model-len 1024`` (1 MiB of KV for one full-length
request), so static serves m0 alone and m1's requests fail as "not served"; the elastic engines share the
1.5 MiB under one device budget and serve both; ``elastic-kv serve`` keeps one model awake at a time, so
m1's first burst wakes it (a cold start on the CPU) once m0 is idle and put to sleep. One run of the script
covers all three set-ups; the tests read what it wrote.

Requests are 192-240 tokens (prompts 32-48, outputs 160-192): each ends on two 128-token blocks, so a burst
backs up to 8 pages (128 KiB each) beside the null block, against an idle pool of the null block and one
reserve page (256 KiB; the reserve's cap is 4 pages), and decodes for about 0.35 s on an idle CPU (longer
under load) -- several 0.1 s KV samples. Shorter requests (16-48 + 16-32 tokens) finished in about 50 ms
and held more than the idle pool for about 0.12 s of m0's burst in all, in two stretches: a 0.1 s sampler
missed them about half the time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from benchmarks.multimodel.setups import serve_available

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_model.py"
KV_TOTAL = 1536 << 10
ARGS = [
    "--device", "cpu", "--models", "2", "--loads", "2", "--bursts", "3", "--burst-size", "4",
    "--burst-spread", "0.5", "--prompt", "32:48", "--output", "160:192", "--seed", "7",
    "--kv-total", str(KV_TOTAL), "--max-model-len", "1024", "--idle-sleep", "5", "--settle", "0.5",
    "--sample-period", "0.1", "--request-timeout", "1500",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("multi_model")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *ARGS],
        capture_output=True,
        text=True,
        timeout=2400,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done


@pytest.fixture(scope="module")
def results(run: tuple[Path, subprocess.CompletedProcess[str]]) -> dict[str, Any]:
    out, _ = run
    return json.loads((out / "results.json").read_text())


def _load(results: dict[str, Any], setup: str) -> dict[str, Any]:
    return results["setups"][setup]["loads"]["2"]


def test_report_states_trace_and_slo_and_covers_every_setup(
    run: tuple[Path, subprocess.CompletedProcess[str]], results: dict[str, Any]
) -> None:
    out, done = run
    assert "3 bursts x 4 requests" in results["trace"] and "CV 3" in results["trace"]
    assert results["slo"].startswith("TTFT <= ")
    expected = ["static", "elastic", "sleep"] if serve_available() else ["static", "elastic"]
    assert [s for s in results["setups"] if results["setups"][s].get("loads")] == expected
    for setup in expected:
        run_ = _load(results, setup)
        assert run_["requests"] == 12 and run_["burst_models"] == [0, 1, 1]
        m = run_["metrics"]
        for key in ("slo_attainment", "goodput_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            assert m[key] is not None, (setup, key)
        assert "outcomes" not in run_  # per-request rows stay in <setup>.json
    report = (out / "report.md").read_text()
    assert "## SLO attainment by load" in report and results["slo"] in report
    png = out / "kv_memory_load2.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| load req/s |" in done.stdout  # the report is printed too


def test_static_holds_only_the_engines_that_fit(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    static = json.loads((out / "static.json").read_text())
    assert list(static["engines"]) == ["m0"] and static["kv_total_bytes"] == KV_TOTAL
    outcomes = static["loads"]["2"]["outcomes"]
    assert all(o["ok"] for o in outcomes if o["model"] == "m0")
    assert {o["error"] for o in outcomes if o["model"] == "m1"} == {"not served"}
    m = static["loads"]["2"]["metrics"]
    assert m["models_served"] == 1 and m["failed"] == 8 and m["errors"] == {"not served": 8}
    # its KV is fixed: the whole total, all of it m0's
    assert all(s["kv"] == {"m0": KV_TOTAL, "m1": 0} for s in static["loads"]["2"]["memory"])


def test_elastic_serves_both_models_within_one_budget(results: dict[str, Any]) -> None:
    run_ = _load(results, "elastic")
    m = run_["metrics"]
    assert m["failed"] == 0, m["errors"]
    assert m["models_served"] == 2
    assert run_["budget_bytes"] == KV_TOTAL
    memory = run_["memory"]
    assert all(sum(s["kv"].values()) <= KV_TOTAL for s in memory)
    # memory followed the bursts: each model backed more than its idle reserve at some point, and more than
    # it held before the trace began (a reserve the warm-up left, trimmed later, is no growth)
    for model in ("m0", "m1"):
        kv = [s["kv"][model] for s in memory]
        assert max(kv) > min(kv), (model, kv)
        assert max(kv) > kv[0], (model, kv)


@pytest.mark.skipif(not serve_available(), reason="elastic-kv serve is not installed")
def test_sleep_setup_wakes_the_sleeping_model(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    sleep = json.loads((out / "sleep.json").read_text())
    assert "at most 1 awake" in sleep["describe"]
    run_ = sleep["loads"]["2"]
    assert run_["metrics"]["failed"] == 0, run_["metrics"]["errors"]
    assert run_["metrics"]["models_served"] == 2
    states = [s["state"] for s in run_["memory"] if "state" in s]
    assert states and all(sum(v == "awake" for v in st.values()) <= 1 for st in states)
    assert any(st["m1"] == "awake" for st in states) and any(st["m1"] != "awake" for st in states)
    wakes = {m["name"]: m for m in sleep["final_status"]["models"]}
    assert wakes["m1"]["wakes"] >= 1
    config = (out / "models.toml").read_text()
    assert "[[models]]" in config and 'name = "m1"' in config and "idle_sleep_s = 5" in config
    # what the trace asks of the device served as it arrives, against this set-up's budget (each model's
    # "weights" on the CPU hold the KV total, so two models in flight never fit the budget of one)
    assert sleep["budget_bytes"] > 0 and sleep["model_bytes"] > 0 and sleep["kv_bytes_per_token"] > 0
    report = (out / "report.md").read_text()
    assert "Served as it arrives, as if alone" in report and "requests arrive" in report


def test_nothing_is_left_running(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(out) in cmdline:
            left.append((proc.info["pid"], cmdline))
    assert not left
