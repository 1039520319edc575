"""``ci/gpu_vllm.py``, the GPU proof, runs its whole protocol on the CPU here (``--cpu-smoke``): both engines
up, alternating bursts, the checks printed. CI cannot run the GPU proof; this keeps its wiring (the two
children, the plugin's registration, the pool and rank probes, the A/A mode) from breaking unseen. Its parts
without engines (``benchmarks/gpu_vllm/``: slots, timelines, the A/A line) are checked directly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_vllm.protocol import backend
from benchmarks.gpu_vllm.report import calibration_line
from benchmarks.gpu_vllm.timeline import StepSpans, Timeline

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "gpu_vllm.py"
SMALL = ["--cpu-smoke", "--bursts", "1", "--requests", "4", "--output", "16"]


def run_script(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        # One run: about 200 s on 2 idle cores, 300 s beside the other pytest-xdist worker's engines, and
        # past 600 s on 2 cores shared with more engine jobs.
        timeout=1200,
    )
    # Exit 1 is the throughput check, which one tiny burst on a shared CPU cannot meet; anything else failed.
    assert done.returncode in (0, 1), done.stdout + done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One run of the protocol, --swap: elastic in the slot that starts second (the slot mapping itself is
    checked without engines below)."""
    out = tmp_path_factory.mktemp("gpu_vllm")
    return out, run_script(out, "--swap")


@pytest.mark.slow
def test_elastic_against_native(smoke: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out_dir, done = smoke
    out = done.stdout
    assert "slots: elastic in B, native in A" in out
    assert "greedy outputs: EQUAL" in out
    for check in (
        "greedy outputs equal: ok",
        "idle footprint <= null page + minimum reserve: ok",
        "no driver call in steady decode: ok",
    ):
        assert check in out, out
    # the pool, its arrivals hook and its rank were probed
    assert "elastic: rank applies requests (off the engine thread)" in out
    assert "elastic: arrivals mapped ahead (in add_request)" in out
    assert "by start in the burst: 0-0.1 s" in out  # the scheduler's waits, by when in the burst
    # progress as it goes, so that a run cut short by a time limit still says how far it got
    assert "slot A (native) ready" in done.stderr and "slot B (elastic) ready" in done.stderr
    assert "round 1/1: native" in done.stderr
    # one log a slot, named by slot and backend (under --calibrate both slots run one backend)
    assert sorted(p.name for p in out_dir.glob("gpu_vllm_*.log")) == [
        "gpu_vllm_A_native.log",
        "gpu_vllm_B_elastic.log",
    ]


@pytest.mark.slow
def test_the_a_a_line_reads_slot_a_over_slot_b(smoke: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    # --calibrate runs the protocol above with one backend in both slots and prints this line instead of
    # the checks; here from the two engines' real reports (slot A native, slot B elastic).
    out_dir, _ = smoke
    reports = json.loads((out_dir / "gpu_vllm.json").read_text())
    a, b = reports["native"], reports["elastic"]
    ratios = [x / y for x, y in zip(a["burst_tokens_per_s_each"], b["burst_tokens_per_s_each"], strict=True)]
    line = calibration_line("native", ratios, a, b)
    total = b["burst_seconds"] / a["burst_seconds"]
    assert line.startswith(
        f"A/A (two native engines): ratio slot A / slot B: median {ratios[0]:.4f}, mean {ratios[0]:.4f}, "
        f"total time {total:.4f} ({ratios[0]:.3f}); engine-thread CPU {a['burst_thread_cpu_s']} / "
        f"{b['burst_thread_cpu_s']} s; per burst schedule "
    ), line
    for phase in ("execute", "execute: sample", "update"):
        assert f", {phase} " in line


def test_slots_run_the_backends_asked_for() -> None:
    import argparse

    runs = {
        (swap, calibrate): [
            backend(slot, argparse.Namespace(swap=swap, calibrate=calibrate)) for slot in "AB"
        ]
        for swap, calibrate in ((False, None), (True, None), (False, "native"), (False, "elastic"))
    }
    assert runs == {
        (False, None): ["elastic", "native"],
        (True, None): ["native", "elastic"],
        (False, "native"): ["native", "native"],
        (False, "elastic"): ["elastic", "elastic"],
    }


def test_a_child_starts_its_engine_with_the_parents_options() -> None:
    """The child parses the command line the parent builds: the family's engine options (gdn's prefill
    kernel, the speculative drafts) reach the engine's process."""
    from benchmarks.gpu_vllm.child import _engine_options
    from benchmarks.gpu_vllm.cli import _parser
    from benchmarks.gpu_vllm.protocol import _command

    parent = _parser().parse_args(["--model", "gdn", "--speculative", "ngram"])
    parent.model_dir, parent.cpu_split = "/models/gdn", None
    command = _command("A", parent)
    child = _parser().parse_args(command[command.index("--child") :])
    assert (child.child, child.model, child.speculative) == ("A", "gdn", "ngram")
    options = _engine_options(child, backend("A", child))
    assert options["additional_config"] == {"kv_cache_backend": "elastic", "gdn_prefill_backend": "triton"}
    assert options["speculative_config"]


def test_step_spans_sort_steps_by_kind_and_by_the_ranks_maps() -> None:
    # --gpu-times reads CUDA events, which this machine has not: its bookkeeping runs here on events that
    # read a counter (one tick a record or a map), the spans and gaps checked exactly.
    import itertools
    from types import SimpleNamespace

    clock = itertools.count()

    class Event:
        def record(self) -> None:
            self.t = next(clock)

        def elapsed_time(self, later: Event) -> float:
            return float(later.t - self.t)

    class Executor:
        def execute_model(self, scheduler_output: object) -> None:
            return None

        def sample_tokens(self) -> str:
            return "sampled"

    class Rank:
        def map(self, pages: list[int]) -> None:
            next(clock)

    spans = StepSpans()
    spans._event = Event
    executor, rank = Executor(), Rank()
    spans.wrap_engine(executor)
    spans.wrap_maps(rank)

    def step(tokens: int, requests: int) -> None:
        output = SimpleNamespace(total_num_scheduled_tokens=tokens)
        output.num_scheduled_tokens = dict.fromkeys(range(requests), 1)
        executor.execute_model(output)
        assert executor.sample_tokens() == "sampled"

    step(4, 4)  # before the burst: not timed
    spans.begin()  # tick 0
    next(clock)  # the requests are taken in: tick 1
    step(64, 4)  # prefill: ticks 2-3, lead 2
    step(4, 4)  # decode: 4-5, idle gap 1
    rank.map([1])  # tick 6
    step(4, 4)  # decode, the rank mapped since the last step ended: 7-8, gap 2
    next(clock)  # the last output is returned: tick 9
    spans.end()  # tick 10, tail 2
    step(4, 4)  # after the burst: not timed
    spans.burst_done()
    assert spans.report() == {
        "decode": {"steps": 1, "span_ms": 1.0, "gap_ms": 1.0},
        "decode, rank mapping": {"steps": 1, "span_ms": 1.0, "gap_ms": 2.0},
        "prefill": {"steps": 1, "span_ms": 1.0, "gap_ms": 0.0},
    }
    assert spans.edges_report() == {"lead_ms": 2.0, "first_ms": 1.0, "tail_ms": 2.0}


def test_timeline_sums_each_bursts_first_and_last_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    clock = iter(range(1000))
    fake_time = SimpleNamespace(perf_counter=lambda: float(next(clock)), thread_time=lambda: 0.0)
    monkeypatch.setattr("benchmarks.gpu_vllm.timeline.time", fake_time)

    class Scheduler:
        def update_from_output(self) -> None:
            next(clock)  # every call takes 2 ticks on the wall clock (the call itself and the read after)

        def schedule(self) -> None:
            return None

    sched = Scheduler()
    timeline = Timeline()
    timeline.wrap(sched, "update_from_output", "update", edges=True)
    timeline.wrap(sched, "schedule", "schedule")
    sched.update_from_output()  # outside a burst: not timed
    for calls in (3, 1):  # two bursts
        timeline.begin(0.0)
        for _ in range(calls):
            sched.update_from_output()
            sched.schedule()
        timeline.end()
    report = timeline.report()
    assert report["update"]["calls"] == 4 and report["update"]["s"] == 8.0
    assert report["update"]["first_last_s"] == [4.0, 4.0]  # 2 + 2 first calls, 2 + 2 last calls
    assert "first_last_s" not in report["schedule"]
