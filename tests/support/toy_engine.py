"""A small OpenAI-style engine that sleeps through its API, for ``elastic-kv serve``'s tests on the CPU.

vLLM and SGLang cannot sleep through their APIs on the CPU (their platforms refuse sleep mode), so the
server's host-memory decisions -- level 1 into the host arena, level 2, a stop -- need an engine that can.
This is a real process serving real HTTP (FastAPI on uvicorn), started by the server as an
``engine = "command"`` model: its "weights" are the bytes of ``weights.bin`` in the model folder, held in
memory while awake; every answer is derived from the prompt and a digest of the weights held, so a wake
that restored them wrongly answers differently.

    python toy_engine.py --port P --model DIR [--start-delay S] [--token-ms MS]

Routes: ``GET /health``, ``POST /v1/completions`` (``prompt``, ``max_tokens``; takes ``token-ms`` per token;
``kv_bytes``: KV the request holds while it runs, charged 1 MiB at a time to the engine's real pool record in
the registry named by ``ELASTIC_KV_REGISTRY_DIR``, waiting for the budget while a charge is refused, as an
elastic engine's pool grows page by page; under a pool limit below its charge the newest requests give KV
back until the pool fits, as an engine preempts, and grow again while they run),
``POST /sleep?level=1`` (the weights into an extent of the host arena named by ``ELASTIC_KV_HOST_ARENA``,
owned by ``ELASTIC_KV_POOL_NAME``, then dropped), ``POST /sleep?level=2`` (dropped), ``POST
/wake_up?level=N`` (copied back and the extent given back, or read again from ``weights.bin``; an awake
engine stays as it is), ``POST /demote`` (asleep at level 1: the extent given back, asleep at level 2 from
then on; otherwise 409). ``&mode=keep`` suspends the running requests, as vLLM's ``mode=keep`` does: they give
their KV back (preempted) and pause while it sleeps, then grow it again and finish after the wake-up;
with ``--park-keep`` they keep it instead, as the vLLM plugin parks it in host memory (its charge stays on
the record): in an extent of the arena taken before the weights', where one fits (else it stays on the
device and counts as not parked), and the sleep answers ``{"parked_bytes": N}``. A level-1 sleep the arena
has no room for left is refused (500, still awake): the server must not ask for it. ``--refuse-keep``
answers a keep-mode sleep with 409 and stays awake. ``GET /stats``: preemptions, and the requests suspended
by a sleep. ``POST /fail_core``: the engine's core dies behind its live server, as vLLM's
engine core can while its API server waits for clients to close their connections: ``/health`` answers 503
from then on, and completions, sleeps and wakes wait for an answer that never comes. A completion whose
body names a file in ``die_once`` that does not exist yet creates it and ends the process at once, holding
the request (an engine that dies under a request, once).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import uvicorn
from elastic_kv.host import Extent, HostArena
from elastic_kv.registry import PoolRecord
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

WEIGHTS = "weights.bin"
KV_STEP = 1 << 20


def make_checkpoint(path: Path, nbytes: int, seed: int) -> Path:
    """A model folder whose ``weights.bin`` holds ``nbytes`` bytes derived from ``seed``."""
    path.mkdir(parents=True, exist_ok=True)
    block = hashlib.sha256(str(seed).encode()).digest() * 1024
    data = (block * (nbytes // len(block) + 1))[:nbytes]
    (path / WEIGHTS).write_bytes(data)
    return path


def answer(prompt: str, weights: bytes, n: int) -> str:
    """What the engine answers ``prompt`` with, given its weights."""
    digest = hashlib.sha256(hashlib.sha256(weights).digest() + prompt.encode()).hexdigest()
    return " ".join(digest[i % 60 : i % 60 + 4] for i in range(n))


class Engine:
    def __init__(self, model: Path, token_s: float) -> None:
        self.model = model
        self.token_s = token_s
        self.weights: bytes | None = (model / WEIGHTS).read_bytes()
        self.awake = asyncio.Event()
        self.awake.set()
        self.suspended = 0  # requests that were running when a keep-mode sleep came
        path = os.environ.get("ELASTIC_KV_HOST_ARENA")
        self.arena = HostArena.open(Path(path)) if path else None
        self.owner = os.environ.get("ELASTIC_KV_POOL_NAME", "toy")
        self.extent: Extent | None = None
        self.kv_extent: Extent | None = None  # a suspension's parked KV
        self.level = 0
        self.running: list[list[int]] = []  # KV each running request holds, oldest first
        self.preemptions = 0
        registry = os.environ.get("ELASTIC_KV_REGISTRY_DIR")
        self.record: PoolRecord | None = None
        if registry:
            self.record = PoolRecord.create(
                self.owner, device="toy0", engine="toy", model=str(model), limit_bytes=0,
                registry_dir=Path(registry),
            )  # fmt: skip

    async def hold_kv(self, held: list[int], nbytes: int) -> None:
        """Charge ``nbytes`` of KV step by step into ``held[0]``, waiting while limit or budget refuse."""
        while self.record is not None and held[0] < nbytes:
            await self.awake.wait()  # a suspended request charges nothing while the engine sleeps
            self.follow_limit()
            if self.record.try_charge(KV_STEP):
                held[0] += KV_STEP
            else:
                await asyncio.sleep(0.05)

    def follow_limit(self) -> None:
        """Under a limit below the pool's charge, give back KV from the newest requests until it fits."""
        record = self.record
        if record is None or not record.limit_bytes:
            return
        for held in reversed(self.running):
            over = record.charged_bytes - record.limit_bytes
            if over <= 0:
                return
            back = min(held[0], -(-over // KV_STEP) * KV_STEP)
            if back:
                record.uncharge(back)
                held[0] -= back
                self.preemptions += 1

    def preempt_all(self) -> None:
        """Every running request gives its KV back (it grows it again once the engine wakes)."""
        for held in self.running:
            if held[0] and self.record is not None:
                self.record.uncharge(held[0])
                held[0] = 0
                self.preemptions += 1
            self.suspended += 1

    def park(self, nbytes: int) -> int:
        """A suspension's KV into an arena extent (where there is an arena); the bytes parked (0: no room)."""
        if self.arena is None or not nbytes:
            return nbytes
        self.kv_extent = self.arena.take(nbytes, self.owner)
        return nbytes if self.kv_extent is not None else 0

    def sleep(self, level: int) -> None:
        assert self.weights is not None, "asleep already"
        if level == 1:
            extent = self.arena.take(len(self.weights), self.owner) if self.arena is not None else None
            if extent is None:
                self.unpark()
                raise RuntimeError("level 1 needs room in a host arena")
            self.arena.view(extent)[: len(self.weights)] = self.weights  # type: ignore[union-attr]
            self.extent = extent
        self.awake.clear()
        self.weights = None
        self.level = level

    def unpark(self) -> None:
        if self.arena is not None and self.kv_extent is not None:
            self.arena.give_back(self.kv_extent)
        self.kv_extent = None

    def demote(self) -> None:
        """Asleep at level 1: give the arena extent back and be asleep at level 2."""
        if self.level != 1 or self.arena is None or self.extent is None:
            raise RuntimeError(f"not asleep at level 1 (level {self.level})")
        self.arena.give_back(self.extent)
        self.extent = None
        self.level = 2

    def wake(self, level: int) -> None:
        if self.weights is not None:
            return  # awake already
        assert level == self.level, (level, self.level)
        if level == 1:
            assert self.arena is not None and self.extent is not None
            size = (self.model / WEIGHTS).stat().st_size
            self.weights = bytes(self.arena.view(self.extent)[:size])
            self.arena.give_back(self.extent)
            self.extent = None
        else:
            self.weights = (self.model / WEIGHTS).read_bytes()
        self.unpark()
        self.level = 0
        self.awake.set()


def build_app(engine: Engine, refuse_keep: bool = False, park_keep: bool = False) -> FastAPI:
    app = FastAPI()

    core_dead = asyncio.Event()

    async def core() -> None:
        """Returns while the core lives; never once it died (a request to it waits forever)."""
        if core_dead.is_set():
            await asyncio.Event().wait()

    @app.get("/health")
    async def health() -> Any:
        if core_dead.is_set():
            return JSONResponse({"error": "engine core died"}, status_code=503)
        return {"status": "ok"}

    @app.post("/fail_core")
    async def fail_core() -> dict[str, str]:
        core_dead.set()
        return {"core": "dead"}

    @app.get("/stats")
    async def stats() -> dict[str, int]:
        return {"preemptions": engine.preemptions, "suspended": engine.suspended}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        marker = body.get("die_once")
        if marker and not Path(marker).exists():  # the process dies holding this request, once
            Path(marker).touch()
            os._exit(1)
        await core()
        if engine.weights is None:
            return JSONResponse({"error": {"message": "asleep", "code": 503}}, status_code=503)
        n = int(body.get("max_tokens", 8))
        held = [0]
        engine.running.append(held)
        try:
            want = int(body.get("kv_bytes", 0))
            await engine.hold_kv(held, want)
            left = n * engine.token_s  # seconds of "decoding" left; none passes while the engine sleeps
            while left > 0:  # follow the limit, grow back what was given
                if not engine.awake.is_set():
                    await engine.awake.wait()
                engine.follow_limit()
                if held[0] < want and engine.record is not None and engine.record.try_charge(KV_STEP):
                    held[0] += KV_STEP
                t0 = time.monotonic()
                await asyncio.sleep(min(0.05, left))
                if engine.awake.is_set():
                    left -= time.monotonic() - t0
        finally:
            engine.running.remove(held)
            if held[0] and engine.record is not None:
                engine.record.uncharge(held[0])
        assert engine.weights is not None
        text = answer(str(body.get("prompt", "")), engine.weights, n)
        return {"object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}  # fmt: skip

    @app.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> Any:
        await core()
        if mode == "keep":
            if refuse_keep:
                return JSONResponse({"error": "this engine cannot keep requests asleep"}, status_code=409)
            if park_keep:
                parked = engine.park(sum(held[0] for held in engine.running))
                engine.sleep(level)
                engine.suspended += len(engine.running)
                return {"level": level, "parked_bytes": parked}
            engine.preempt_all()
        engine.sleep(level)
        return {"level": level}

    @app.post("/demote")
    async def demote() -> Any:
        await core()
        try:
            engine.demote()
        except RuntimeError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return {"level": 2}

    @app.post("/wake_up")
    async def wake_up(level: int = 1) -> dict[str, int]:
        await core()
        engine.wake(level)
        return {"level": level}

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--start-delay", type=float, default=0.0, help="seconds before it serves")
    p.add_argument("--token-ms", type=float, default=0.0, help="milliseconds per generated token")
    p.add_argument("--refuse-keep", action="store_true", help="answer a keep-mode sleep with 409")
    p.add_argument("--park-keep", action="store_true", help="keep-mode sleeps park the requests' KV")
    args = p.parse_args()
    time.sleep(args.start_delay)
    engine = Engine(args.model, args.token_ms / 1000)
    app = build_app(engine, args.refuse_keep, args.park_keep)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
