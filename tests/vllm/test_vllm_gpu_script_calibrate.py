"""``ci/gpu_vllm.py --calibrate``, the A/A run that measures a machine's noise, on the CPU: two elastic
engines in the two slots, the A/A ratio printed. A module of its own, so that the test runners can run it
beside ``test_vllm_gpu_script_smoke.py`` (each starts two engines for minutes on a 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.test_vllm_gpu_script_smoke import run_script

pytestmark = pytest.mark.vllm


@pytest.mark.slow
def test_calibration_runs_two_engines_of_one_backend(tmp_path: Path) -> None:
    # Which backend each slot gets under --calibrate is checked without engines in the smoke module.
    out = run_script(tmp_path, "--calibrate", "elastic").stdout
    assert out.startswith("A/A (two elastic engines): ratio slot A / slot B: median"), out
    logs = sorted(p.name for p in tmp_path.glob("gpu_vllm_*.log"))
    assert logs == ["gpu_vllm_A_elastic.log", "gpu_vllm_B_elastic.log"]
