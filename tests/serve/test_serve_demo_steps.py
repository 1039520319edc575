"""The demo's closing lines (``examples/serve_demo.py``, ``next_steps``) lead to a working request: each
command it prints runs, as printed, against a kept server and answers."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.models import REPO_ROOT
from tests.support.serve import ServeProcess
from tests.support.toy_engine import answer, make_checkpoint


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeProcess]:
    model = make_checkpoint(tmp_path / "alpha", 1 << 20, 3)
    toy = str(REPO_ROOT / "tests" / "support" / "toy_engine.py")
    (tmp_path / "serve").mkdir()
    srv = ServeProcess(
        tmp_path / "serve",
        {},
        [{"name": "alpha", "engine": "command", "model": str(model), "idle_sleep_s": 0,
          "command": [sys.executable, toy, "--port", "{port}", "--model", "{model}"]}],
    )  # fmt: skip
    try:
        srv.wait_for({"alpha": "awake"}, timeout_s=60)
        yield srv
    finally:
        srv.stop()


def test_every_command_the_demo_prints_works(
    server: ServeProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    try:
        from serve_demo import next_steps
    finally:
        sys.path.remove(str(REPO_ROOT / "examples"))
    next_steps(server, keep=True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "Try it (the server stays up until Ctrl-C):"
    curl, status, pools = (shlex.split(line) for line in lines[1:])
    reply = subprocess.run(curl, capture_output=True, text=True, timeout=60, check=True)
    weights = (tmp_path / "alpha" / "weights.bin").read_bytes()
    assert f'"text":"{answer("pages are mapped", weights, 16)}"' in reply.stdout.replace(": ", ":")
    shown = subprocess.run(status, capture_output=True, text=True, timeout=60, check=True)
    assert "alpha" in shown.stdout and "awake" in shown.stdout
    listed = subprocess.run(pools, capture_output=True, text=True, timeout=60, check=True)
    assert "serve.alpha" in listed.stdout
