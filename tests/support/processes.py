"""Stopping a child process that tests, benchmarks and the demo start (an engine, a server)."""

from __future__ import annotations

import subprocess
from typing import Any


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 60.0, *, terminate: bool = True) -> None:
    """End ``proc`` if it still runs: SIGTERM (unless ``terminate`` is false, for a process already told
    to end another way), up to ``timeout_s`` to exit, then SIGKILL; it is reaped in any case."""
    if proc.poll() is not None:
        return
    if terminate:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
