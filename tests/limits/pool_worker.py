"""A real process that owns one pool record, driven line by line from a test over stdin/stdout.

Started by ``conftest.PoolProcess``. It creates the record from its arguments, answers ``{"ready": ...}``
and then one JSON line per command:

    charge N | uncharge N | poll | state | headroom | observe OP SECONDS
    publish USED TOTAL MAPPED HITS MISSES [PREEMPTIONS [LARGEST_REQUEST_BYTES [FAILED]]]
    fork-sleeper            fork a child that inherits the record (and its lock) and sleeps
    follow STEP             background loop: poll, shrink to a lowered limit, charge STEP while it fits
    hammer SEED SECONDS MAX random charges/uncharges of up to MAX bytes for SECONDS; answers when done
    stop                    stop the follow loop and report what it saw
    close | exit            close the record / exit *without* closing it (atexit must clean up)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from typing import Any

from elastic_kv.registry import PoolRecord
from elastic_kv.snapshot import PoolSnapshot, PoolState


def reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


class Follower:
    """Plays the ledger under a changing limit: grows by ``step`` while it fits, shrinks when lowered."""

    def __init__(self, record: PoolRecord, step: int) -> None:
        self.record = record
        self.step = step
        self.stop = threading.Event()
        self.limit_events: list[int] = []
        self.violations: list[dict[str, int]] = []
        self.charges = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        rec = self.record
        while not self.stop.is_set():
            if rec.poll().limit_changed:
                limit = rec.limit_bytes
                self.limit_events.append(limit)
                if limit and rec.charged_bytes > limit:
                    rec.uncharge(rec.charged_bytes - limit)  # what the ledger does as blocks drain
            before = rec.limit_bytes
            if rec.try_charge(self.step):
                self.charges += 1
                charged, after = rec.charged_bytes, rec.limit_bytes
                # A limit read before and after the charge that agree is the limit the charge ran under.
                if before == after and after and charged > after:
                    self.violations.append({"charged": charged, "limit": after})
            time.sleep(0.0005)


def hammer(record: PoolRecord, seed: int, seconds: float, max_bytes: int) -> dict[str, int]:
    rng = random.Random(seed)
    held = ok = refused = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if held and rng.random() < 0.45:
            n = rng.randint(1, held)
            record.uncharge(n)
            held -= n
        else:
            n = rng.randint(1, max_bytes)
            if record.try_charge(n):
                held += n
                ok += 1
            else:
                refused += 1
        if record.charged_bytes != held:
            return {"error": 1, "held": held, "charged": record.charged_bytes}
    return {"held": held, "ok": ok, "refused": refused}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--engine", default="test")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--total", type=int, default=0)
    args = parser.parse_args()
    record = PoolRecord.create(
        args.name,
        device=args.device,
        engine=args.engine,
        model=args.model,
        limit_bytes=args.limit,
        device_total_bytes=args.total,
    )
    reply({"ready": True, "name": record.name, "pid": os.getpid(), "path": str(record.path)})
    follower: Follower | None = None
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "charge":
            reply({"ok": record.try_charge(int(rest[0])), "charged": record.charged_bytes})
        elif cmd == "uncharge":
            try:
                record.uncharge(int(rest[0]))
                reply({"ok": True, "charged": record.charged_bytes})
            except ValueError as exc:
                reply({"ok": False, "error": str(exc), "charged": record.charged_bytes})
        elif cmd == "poll":
            ev = record.poll()
            reply({"limit_changed": ev.limit_changed, "trim_requested": ev.trim_requested,
                   "limit": record.limit_bytes, "headroom": record.headroom_bytes})  # fmt: skip
        elif cmd == "state":
            reply({"charged": record.charged_bytes, "limit": record.limit_bytes,
                   "budget": record.budget_bytes})  # fmt: skip
        elif cmd == "headroom":
            reply({"headroom": record.headroom_bytes})
        elif cmd == "observe":
            record.observe(rest[0], float(rest[1]))
            reply({"ok": True})
        elif cmd == "publish":
            used, total, mapped, hits, misses, *more = (int(x) for x in rest)
            preempted, largest, failed = [*more, 0, 0, 0][:3]
            record.publish(
                PoolSnapshot(
                    name=record.name,
                    state=PoolState.ACTIVE,
                    block_size_bytes=4096,
                    page_size=1 << 21,
                    page_bytes=1 << 21,
                    blocks_per_page=512,
                    total_blocks=total,
                    used_blocks=used,
                    free_blocks=total - used - 1,
                    available_blocks=total - used - 1,
                    total_pages=total // 512,
                    mapped_pages=mapped // (1 << 21),
                    reserve_pages=1,
                    pending_pages=0,
                    inflight_pages=0,
                    mapped_bytes=mapped,
                    limit_bytes=record.limit_bytes,
                    reserve_hits=hits,
                    reserve_misses=misses,
                    epoch=0,
                    timestamp=time.time(),
                    preemptions=preempted,
                    largest_request_bytes=largest,
                    failed_requests=failed,
                )
            )
            reply({"ok": True})
        elif cmd == "fork-sleeper":
            child = os.fork()
            if child == 0:
                time.sleep(60)
                os._exit(0)
            reply({"child": child})
        elif cmd == "follow":
            follower = Follower(record, int(rest[0]))
            follower.thread.start()
            reply({"ok": True})
        elif cmd == "stop":
            assert follower is not None
            follower.stop.set()
            follower.thread.join()
            reply({"limit_events": follower.limit_events, "violations": follower.violations,
                   "charges": follower.charges, "charged": record.charged_bytes})  # fmt: skip
        elif cmd == "hammer":
            reply(hammer(record, int(rest[0]), float(rest[1]), int(rest[2])))
        elif cmd == "close":
            record.close()
            reply({"ok": True})
        elif cmd == "exit":
            reply({"ok": True})
            sys.exit(0)  # without close(): the finalizer registered by PoolRecord must remove the record
        else:
            reply({"error": f"unknown command {cmd}"})


if __name__ == "__main__":
    main()
