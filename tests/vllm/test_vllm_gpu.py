"""The GPU proof as a test (marker ``gpu``: skipped without a CUDA driver): ``ci/gpu_vllm.py`` on a small
burst must pass every check. The full-size run, with its printed summary, is ``python3 ci/gpu_vllm.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "gpu_vllm.py"


def test_gpu_proof_passes(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "64", "--output", "64", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
