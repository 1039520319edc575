"""The front end's clean-up at exit (``vllm_elastic_kv.frontend.exits``), without an engine.

It waits for the child processes that own a pool record (vLLM's engine core, SIGKILLed by its front end,
may still be dying) and for no other: a child that lives as long as the front end (multiprocessing's
resource tracker in ``vllm serve``) must not hold every exit up for the whole wait.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_elastic_kv.frontend.exits import clean_up_after_engine

# A record owner that takes a second to die once told to, and dies without closing its record.
_SLOW_OWNER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    from elastic_kv.registry import PoolRecord

    record = PoolRecord.create("slow", device="cpu", engine="test", model="m", limit_bytes=0,
                               registry_dir=pathlib.Path(sys.argv[1]))
    record.try_charge(4096)

    def die(signum, frame):
        time.sleep(1.0)
        os._exit(0)

    signal.signal(signal.SIGTERM, die)
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        child.kill()
        child.wait(timeout=30)


def test_a_dying_record_owner_is_waited_for_and_its_record_reclaimed(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _SLOW_OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    children.append(owner)
    assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
    assert (tmp_path / "slow.pool").exists()
    owner.send_signal(signal.SIGTERM)  # alive for another second: reclaimed now, its record would stay
    clean_up_after_engine("no-such-instance", 0, tmp_path, wait_s=60)
    assert not (tmp_path / "slow.pool").exists()


def test_a_child_that_owns_no_record_is_not_waited_for(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], text=True)
    children.append(bystander)
    started = time.monotonic()
    clean_up_after_engine("no-such-instance", 0, tmp_path, wait_s=60)
    assert time.monotonic() - started < 30, "the clean-up waited for a child that owns nothing"
    assert bystander.poll() is None
