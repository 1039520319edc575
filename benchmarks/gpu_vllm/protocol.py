"""The protocol between the GPU proof's parent process and its two engine children.

Each engine runs in a child process of its own, ``ci/gpu_vllm.py --child SLOT`` with the parent's options
(:class:`Engine` starts it). The slot's letter decides its backend (:func:`backend`). The child writes its
messages to stdout, one JSON object a line after the prefix :data:`MARK` (:func:`say`; whatever else prints
there is skipped), each with an ``event``: ``ready`` once set up (start-up time, greedy tokens), ``burst``
after each burst (its tokens per second), ``done`` with its report. The parent writes commands to the
child's stdin, one JSON object a line: ``{"cmd": "burst", "seed": N}`` runs a burst; any other command ends
the bursts and asks for the report. The child exits once the parent closes its stdin, so that both engines
keep their memory until both reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("gpu_vllm")
MARK = "@@gpu_vllm "  # prefixes the children's protocol lines on stdout
SLOTS = ("A", "B")  # the children's --child values; A starts first
SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "gpu_vllm.py"  # what each child runs

ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}


def backend(slot: str, args: argparse.Namespace) -> str:
    """The backend a slot runs: elastic in A (in B with ``--swap``), native in the other; with ``--calibrate
    [BACKEND]`` that backend in both (native by default)."""
    if args.calibrate:
        return str(args.calibrate)
    return "elastic" if slot == ("B" if args.swap else "A") else "native"


def say(message: dict[str, Any]) -> None:
    """One protocol line to the parent (stdout also carries whatever else prints there)."""
    print(MARK + json.dumps(message), flush=True)


def _command(slot: str, args: argparse.Namespace) -> list[str]:
    """The child's command line: the parent's options that the engine needs, and the slot's CPUs."""
    cmd = [sys.executable, str(SCRIPT), "--child", slot, "--model-dir", args.model_dir]
    if args.same_layout and shutil.which("setarch"):
        # Two processes of one interpreter differed by 14 % in engine-thread CPU per burst with their
        # randomized address layout and hash seed (--calibrate, two native engines); fixed, 7 %.
        cmd = ["setarch", os.uname().machine, "-R", *cmd]
    cmd += ["--model", args.model]  # the engine's options follow the family (gdn's prefill kernel)
    cmd += ["--requests", str(args.requests), "--prompt", str(args.prompt), "--output", str(args.output)]
    cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    cmd += ["--profile", "--out", args.out] if args.profile else []
    cmd += ["--gc-freeze"] if args.gc_freeze else []
    cmd += ["--gpu-times"] if args.gpu_times else []
    cmd += ["--socket"] if args.socket else []
    cmd += ["--calibrate", args.calibrate] if args.calibrate else []
    cmd += ["--swap"] if args.swap else []
    cmd += ["--speculative", args.speculative] if args.speculative else []
    if args.cpu_split is not None:
        cmd += ["--cpus", ",".join(map(str, args.cpu_split[slot]))]
    return cmd


def _environment(slot: str, args: argparse.Namespace) -> dict[str, str]:
    """The child's environment: this process's with :data:`ENV`, the fixed hash seed, the slot's caches."""
    env = {**os.environ, **ENV}
    if args.same_layout:
        env["PYTHONHASHSEED"] = "0"
    if args.own_caches:
        # Each engine compiles from nothing into caches of its own (same path length for both): a
        # compile cache left by the first would let the second load instead of compile, and so start
        # faster and run with other Python objects than the first.
        caches = Path(args.cache_root or Path(args.model_dir).parent) / f"caches-{slot}"
        env.update(
            VLLM_CACHE_ROOT=str(caches / "vllm"),
            TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
            TRITON_CACHE_DIR=str(caches / "triton"),
        )
    # Pure vLLM loads no plugin; the elastic child registers the plugin itself (see child.py).
    env["VLLM_PLUGINS"] = ""
    return env


class Engine:
    """A child process running one backend's engine, driven line by line (see
    :func:`benchmarks.gpu_vllm.cli.main`); ready once constructed."""

    def __init__(self, slot: str, args: argparse.Namespace) -> None:
        # The two children's command lines and environments differ in nothing but the slot's letter: their
        # sizes shift the process's address layout (see --random-layout).
        self.backend = backend(slot, args)
        # By slot too: with --calibrate both children run one backend, and one log each must not be shared.
        self.log = Path(args.out) / f"gpu_vllm_{slot}_{self.backend}.log"
        self._err = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            _command(slot, args),
            env=_environment(slot, args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self.ready = self._receive("ready")
        logger.info("slot %s (%s) ready: started in %.1f s", slot, self.backend, self.ready["startup_s"])

    def _receive(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                message: dict[str, Any] = json.loads(line[len(MARK) :])
                if message.get("event") == event:
                    return message
        self.proc.wait()
        print(f"{self.backend} engine failed; last lines of {self.log}:", file=sys.stderr)
        print("".join(self.log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        raise SystemExit(1)

    def _send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def burst(self, seed: int) -> float:
        self._send(cmd="burst", seed=seed)
        return float(self._receive("burst")["tokens_per_s"])

    def finish(self) -> dict[str, Any]:
        """The engine's report; it keeps its memory until :meth:`close`."""
        self._send(cmd="finish")
        return {**self.ready, **self._receive("done")}

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()
        self._err.close()
