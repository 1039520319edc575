"""Helpers of the limits tests: a real pool-owning process driven over a pipe, and polling."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("pool_worker.py")


class JsonLineProcess:
    """A worker script driven over a pipe: one command line in, one JSON reply line out."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._label = Path(argv[1]).stem

    def read_reply(self) -> dict[str, Any]:
        """The next JSON line the worker wrote (blocks until there is one)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            raise AssertionError(f"{self._label} died: {self.proc.wait()} {self.proc.stderr.read()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def send(self, command: str) -> dict[str, Any]:
        """Run one command and return its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read_reply()


class PoolProcess(JsonLineProcess):
    """A `pool_worker.py` process owning one pool record; `send` a command, get its JSON reply."""

    def __init__(self, env: dict[str, str], name: str, **options: Any) -> None:
        argv = [sys.executable, str(WORKER), "--name", name]
        for key, value in options.items():
            argv += [f"--{key}", str(value)]
        super().__init__(argv, env)
        ready = self.read_reply()
        assert ready.get("ready"), ready
        self.name: str = ready["name"]
        self.pid: int = ready["pid"]
        self.path = Path(ready["path"])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` and reap the process."""
        self.proc.send_signal(sig)
        self.proc.wait(timeout=10)

    def finish(self) -> int:
        """Close stdin and wait for a normal exit; the exit code."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=10)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
