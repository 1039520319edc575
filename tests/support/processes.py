"""Child processes that tests, benchmarks and the demo start (an engine, a server): waiting for a server to
answer, stopping a process."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import engine_logs

# A server of this machine is asked directly, whatever proxy the environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def wait_healthy(
    proc: subprocess.Popen[Any],
    url: str,
    log: Path,
    timeout_s: float,
    *,
    waiting: Callable[[float], None] | None = None,
) -> None:
    """Return once ``GET url/health`` answers 200. ``RuntimeError`` if ``proc`` (the server) exits first,
    ``TimeoutError`` after ``timeout_s``; either names ``log`` (the server's output) and quotes its tail.
    While it waits, ``waiting(seconds waited)`` is called about once a second (a progress line)."""
    start = time.monotonic()
    while (waited := time.monotonic() - start) < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with {proc.returncode}; see {log}:\n{engine_logs.tail(log)}"
            )
        try:
            with _DIRECT.open(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:  # not listening yet, or answering 503 while it starts
            pass
        if waiting is not None:
            waiting(waited)
        time.sleep(1.0)
    raise TimeoutError(f"the server did not answer in {timeout_s:.0f} s; see {log}:\n{engine_logs.tail(log)}")


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
