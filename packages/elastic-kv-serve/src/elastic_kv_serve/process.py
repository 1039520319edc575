"""One child process, started and stopped the same way by the server, the benchmark and the tests.

A :class:`ChildProcess` appends its output to a log file (one header line per start, so that restarts add
to the same log), leads its own process group, and gets SIGTERM if the process that started it dies
(``PR_SET_PDEATHSIG``; the signal comes when the starting *thread* ends, so start children from a thread
that lives as long as they should). Stopping it sends SIGTERM to the child itself -- a server shuts its own
children down: vLLM's engine core, SGLang's scheduler, ``elastic-kv serve``'s engines -- and, once it has
exited or the grace time is over, SIGKILL to whatever is left of its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = ["ChildProcess"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess:
    """A child process with its log (see the module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        cwd: Path | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 -- closed in kill()
        self._log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.argv,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=_die_with_parent,  # prctl only
        )
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the log ("" when it cannot be read)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self) -> None:
        """SIGTERM the child itself (it shuts its own children down)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> int:
        """SIGKILL whatever is left of the process group, reap the child and close the log (idempotent);
        the exit status."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def stop(self, timeout_s: float) -> int:
        """:meth:`terminate`, up to ``timeout_s`` for the exit, then :meth:`kill`; the exit status."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        return self.kill()

    async def stop_async(self, timeout_s: float = 30.0) -> int:
        """:meth:`stop` for an event loop: the wait does not block it."""
        self.terminate()
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.kill()
