"""The main demo: three models behind one OpenAI endpoint on the CPU, sleeping, waking and sharing memory.

It starts ``elastic-kv serve`` with three distinct tiny local Llamas -- ``alpha`` and ``beta`` on vLLM,
``gamma`` on SGLang (``--engine vllm`` puts all three on vLLM) -- each counting 10 MiB of weights
against a 24 MiB budget, so two fit awake at a time. Then bursts of concurrent requests move from one model
to the next: ``alpha``, ``beta``, ``gamma`` (asleep: the request waits while it wakes, and the least
recently used idle model sleeps to make room), then ``alpha`` again (it wakes the same way). With
``--idle-sleep S`` models idle for S seconds also sleep on their own (off by default: on a shared 2-core
machine a cold start can take minutes, longer than any idle time that keeps the demo short).

A live view (rich) shows each model's state and KV memory (its elastic pool's backed bytes, from the
registry that ``kvctl`` reads) four times a second. The demo ends with a one-line summary that it checks:
every burst's model grew its KV and gave it back afterwards, and some model slept and woke on demand;
otherwise it exits non-zero.

At the end it prints the endpoint and three commands to try next (a completion, ``elastic-kv status``,
``kvctl list``); with ``--keep`` the server stays up for them until Ctrl-C.

    python examples/serve_demo.py [--requests 16] [--max-tokens 160] [--engine sglang|vllm] [--keep]
                                  [--keep-logs]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
from elastic_kv.registry import Registry  # noqa: E402
from elastic_kv_serve.config import pool_name_for  # noqa: E402
from elastic_kv_serve.memory import pool_names  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.live import Live  # noqa: E402
from rich.progress_bar import ProgressBar  # noqa: E402
from rich.table import Table  # noqa: E402
from rich.text import Text  # noqa: E402

from tests.support.models import DISTINCT_SPECS, tiny_model  # noqa: E402
from tests.support.serve import POOL_ENV, SGLANG_CPU_ARGS, VLLM_CPU_ARGS, ServeProcess, sglang_cpu_env  # noqa: E402

MiB = 1 << 20
NAMES = ("alpha", "beta", "gamma")
WORDS = "the quick brown fox jumps over the lazy dog while memory grows and shrinks with load".split()  # noqa: SIM905
STATE_STYLE = {"awake": "green", "asleep": "dim", "waking": "yellow", "starting": "yellow",
               "sleeping": "yellow", "failed": "red", "stopped": "red"}  # fmt: skip
KV_SCALE = 8 * MiB  # the bars' full width


def sglang_model(path: Path) -> dict[str, Any]:
    """SGLang's CPU engine: its switches, the sgl_kernel stand-in, its CPU arguments."""
    # The radix cache keeps finished requests' tokens; bound it so an idle SGLang gives its pages back.
    env = {**sglang_cpu_env(), "ELASTIC_KV_SGLANG_MAX_CACHED_TOKENS": "256"}
    return {"engine": "sglang", "model": str(path), "args": SGLANG_CPU_ARGS, "env": env}


@dataclass
class Timeline:
    """What the live view saw: (t, phase, {model: (state, kv bytes)})."""

    samples: list[tuple[float, str, dict[str, tuple[str, int]]]] = field(default_factory=list)

    def kv(self, model: str, phase: str) -> list[int]:
        return [s[2][model][1] for s in self.samples if s[1] == phase]


class View(threading.Thread):
    """Polls ``/status`` four times a second, draws the table, records the timeline. Each model's KV is read
    from its pool records in the server's registry (what ``kvctl`` reads): the server's own figure is
    refreshed every half second, and a burst can end between two refreshes."""

    def __init__(self, server: ServeProcess, timeline: Timeline, live: Live | None) -> None:
        super().__init__(name="view", daemon=True)
        self.server, self.timeline, self.live = server, timeline, live
        self.registry = Registry(server.registry)
        self.phase = "start-up"
        self.in_flight: dict[str, int] = dict.fromkeys(NAMES, 0)
        self.halt = threading.Event()
        self.t0 = time.monotonic()
        self._last_line = ""
        self._last_states = ""
        self._last_t = 0.0

    def run(self) -> None:
        while not self.halt.wait(0.25):
            try:
                status = self.server.status()
            except httpx.HTTPError:
                continue
            charged = {p.name: p.charged_bytes for p in self.registry.pools(reclaim=False)}
            for name, m in status.items():
                m["kv_bytes"] = sum(charged.get(p, 0) for p in pool_names(pool_name_for(name)))
            t = time.monotonic() - self.t0
            self.timeline.samples.append(
                (t, self.phase, {n: (m["state"], m["kv_bytes"]) for n, m in status.items()})
            )
            if self.live is not None:
                self.live.update(self.table(t, status))
            else:
                self.line(t, status)

    def table(self, t: float, status: dict[str, Any]) -> Table:
        table = Table(title=f"elastic-kv serve  t={t:5.1f}s  phase: {self.phase}", title_justify="left")
        for col in ("model", "engine", "state", "sleep", "KV backed", "", "in flight", "wakes", "sleeps"):
            table.add_column(
                col, justify="right" if col in ("KV backed", "in flight", "wakes", "sleeps") else "left"
            )
        for name, m in status.items():
            table.add_row(
                name, m["engine"], Text(m["state"], style=STATE_STYLE.get(m["state"], "")), m["sleep_mode"],
                f"{m['kv_bytes'] / MiB:6.2f} MiB",
                ProgressBar(total=KV_SCALE, completed=min(KV_SCALE, m["kv_bytes"]), width=24),
                str(m["in_flight"]), str(m["wakes"]), str(m["sleeps"]),
            )  # fmt: skip
        return table

    def line(self, t: float, status: dict[str, Any]) -> None:
        cells = "  ".join(f"{n}:{m['state']:<8} KV {m['kv_bytes'] / MiB:5.2f} MiB" for n, m in status.items())
        line = f"{self.phase:<16} {cells}"
        states = self.phase + "".join(m["state"] for m in status.values())
        # Every change of phase or state at once; memory changes at most once a second; while nothing
        # changes (a cold start takes a minute or more on 2 cores), a line every 15 s says what it waits for.
        waiting = [f"{n} {m['state']}" for n, m in status.items() if m["state"] in ("starting", "waking")]
        quiet = t - self._last_t >= 15.0
        if states != self._last_states or (line != self._last_line and t - self._last_t >= 1.0) or quiet:
            note = f"  (waiting: {', '.join(waiting)})" if quiet and waiting else ""
            print(f"  {t:6.1f}s  {line}{note}", flush=True)
            self._last_line, self._last_states, self._last_t = line, states, t


def burst(server: ServeProcess, model: str, n: int, max_tokens: int) -> tuple[int, float]:
    """``n`` concurrent completions to ``model``; (tokens generated, seconds)."""

    def one(i: int) -> int:
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(30 + 9 * (i % 11))]
        body = {"model": model, "prompt": " ".join(words), "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=900)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        tokens = sum(pool.map(one, range(n)))
    return tokens, time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests per burst")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens generated per request")
    parser.add_argument(
        "--engine", choices=("sglang", "vllm"), default="sglang", help="the third model's engine"
    )
    parser.add_argument(
        "--idle-sleep",
        type=float,
        default=0.0,
        help="seconds idle before a model sleeps (default 0: only to make room)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the server up at the end (Ctrl-C stops it) to try it"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the server's and engines' logs")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="elastic-kv-serve-demo-"))
    paths = [tiny_model(spec) for spec in DISTINCT_SPECS]
    models: list[dict[str, Any]] = []
    for i, (name, path) in enumerate(zip(NAMES, paths, strict=True)):
        entry = {"engine": "vllm", "model": str(path), "args": VLLM_CPU_ARGS, "env": POOL_ENV}
        if i == 2 and args.engine == "sglang":
            entry = sglang_model(path)
        models.append({"name": name, **entry, "weights_bytes": "10M"})
    server_cfg = {
        "budget": "24M",
        "host_budget": "64M",
        "idle_sleep_s": args.idle_sleep,
        "wake_timeout_s": 600,
    }
    print("elastic-kv demo: three models, one OpenAI endpoint, a 24 MiB budget that holds two awake")
    for m in models:
        print(f"  {m['name']:<6} {m['engine']:<7} {m['model']}")
    server = ServeProcess(work, server_cfg, models)
    print(f"  elastic-kv serve --config {server.config}  (log {server.log_path})")
    print(f"  endpoint: {server.url}/v1 (OpenAI API); the first start of an engine takes a minute or more")
    timeline = Timeline()
    console = Console()
    ok = False
    try:
        with (
            Live(console=console, refresh_per_second=4, transient=False)
            if console.is_terminal
            else contextlib.nullcontext() as live
        ):
            view = View(server, timeline, live)
            view.start()
            server.wait_for({"beta": "awake"})  # the start-up starts alpha, then beta
            plan = [
                ("alpha", "burst alpha"),
                ("beta", "burst beta"),
                ("gamma", "burst gamma"),
                ("alpha", "alpha again"),
            ]
            results = []
            for model, phase in plan:
                view.phase = phase
                tokens, took = burst(server, model, args.requests, args.max_tokens)
                results.append(f"{phase}: {tokens} tokens in {took:.1f} s")
                view.phase = f"after {phase}"
                time.sleep(4)
            view.halt.set()
            view.join()
        for line in results:
            print(f"  {line}")
        print("  $ kvctl list   (the pools of the awake engines, in the server's registry)")
        listed = subprocess.run(
            [sys.executable, "-m", "elastic_kv.cli.kvctl", "--registry-dir", str(server.registry), "list"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        for line in (listed.stdout + listed.stderr).rstrip().splitlines():
            print(f"    {line}")
        status = server.status()
        ok = summarize(timeline, status, plan)
        next_steps(server, args.keep)
        if args.keep:
            with contextlib.suppress(KeyboardInterrupt):
                while server.proc.poll() is None:
                    time.sleep(1)
    finally:
        code = server.stop()
        if code != -signal.SIGTERM:  # a drained server exits by the SIGTERM it got
            print(f"  the server exited with {code}; log {server.log_path}")
            ok = False
        if not args.keep_logs and ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"  logs kept in {work}")
    return 0 if ok else 1


def next_steps(server: ServeProcess, keep: bool) -> None:
    """What to try against the server: a completion, its status, the pools (the server's own registry)."""
    bin_dir = Path(sys.executable).parent
    body = '{"model": "alpha", "prompt": "pages are mapped", "max_tokens": 16}'
    when = "the server stays up until Ctrl-C" if keep else "rerun with --keep to keep the server up"
    print(f"\nTry it ({when}):")
    print(f"  curl -s {server.url}/v1/completions -H 'content-type: application/json' -d '{body}'")
    print(f"  {bin_dir / 'elastic-kv'} status --url {server.url}")
    print(f"  {bin_dir / 'kvctl'} --registry-dir {server.registry} list")


def summarize(timeline: Timeline, status: dict[str, Any], plan: list[tuple[str, str]]) -> bool:
    """Print the one-line summary and check it: each burst's model grew its KV during the burst and held
    less in the idle seconds after it; some model slept, and some model woke on demand."""
    flows = []
    grew_and_shrank = True
    for model, phase in plan:
        peak = max(timeline.kv(model, phase), default=0)
        low = min(timeline.kv(model, f"after {phase}"), default=peak)
        grew_and_shrank &= peak > 0 and low < peak
        flows.append(f"{model} {peak / MiB:.2f}->{low / MiB:.2f} MiB")
    slept = sum(m["sleeps"] for m in status.values())
    woke = sum(m["wakes"] for m in status.values())
    p50 = [m["wake_p50_s"] for m in status.values() if m["wake_p50_s"] is not None]
    print(
        f"\nKV peak->after each burst: {'; '.join(flows)}; sleeps {slept}, wakes {woke}"
        + (f" (wake p50 {min(p50):.1f}-{max(p50):.1f} s, cold starts)" if p50 else "")
    )
    ok = grew_and_shrank and slept > 0 and woke > 0
    print("demo check: memory flowed from model to model, models slept and woke:", "ok" if ok else "FAILED")
    return ok


if __name__ == "__main__":
    sys.exit(main())
