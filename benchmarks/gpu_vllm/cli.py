"""GPU proof of vllm-elastic-kv on real hardware (vLLM 0.26 on the H200; vLLM from ci/gpu-bundle/).

Starts two engines on the GPU, one native and one with ``--kv-cache-backend=elastic``, each in a process of
its own, with CUDA graphs and torch.compile on (vLLM's defaults), and prints one summary:

* greedy outputs, elastic == native, token for token, on a batch of varied prompts;
* GPU memory each engine uses before / during / after a burst, from the driver's free-memory readings, and
  the pool's own snapshot -- an idle elastic engine must hold no more than the null block's page and its
  minimum reserve;
* throughput elastic / native on bursts from idle (goal >= 0.99): both engines stay up, and each round runs
  the same burst on one engine, then the other (alternating which goes first), while the other idles, so
  that the machine's drift -- a shared host's CPUs vary by tens of percent from one process or minute to
  the next -- hits both alike; the ratio is the median over rounds;
* the share of decode steps whose scheduling waited for a driver call (goal: none in steady state);
* engine start-up time, elastic - native, each compiling into fresh caches of its own (``--shared-caches``
  to let the second engine load what the first compiled; ``--cache-root DIR`` keeps each slot's caches for
  the next run, which loads what matches vLLM's cache keys instead of compiling it);
* a timeline of where the engine thread's time went in the bursts
  (:class:`~benchmarks.gpu_vllm.timeline.Timeline`).

What limits the throughput ratio's precision is the engine *process*, not the rounds: two native engines
(``--calibrate``, an A/A run) differ by several percent in engine-thread CPU time per burst, every phase
alike, although they run the same code on the same cores. The script fixes the address layout and hash
seed of both processes (the default: ``setarch -R``, ``PYTHONHASHSEED=0``; ``--random-layout`` keeps them
random), which narrows that difference without removing it: compare an A/B run with an A/A run made the
same way, or run A/B twice, the second time with ``--swap`` (elastic in the slot that starts second): the
geometric mean of the two ratios cancels whatever the slots themselves differ by. CPU cores (``--pin``):
by default both engines run on the same cores (one bursts while the other idles) and this script on cores
of its own; ``split`` gives each engine cores of its own; ``none`` pins nothing.

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: TP=1 uses vLLM's uni executor, so the
worker is in-process too) so the script can read the scheduler's pool and the worker's data plane directly;
both backends run that way. Neither loads plugins through vLLM (``VLLM_PLUGINS=""``, so the native run is pure
vLLM); the elastic run calls ``vllm_elastic_kv.register()`` itself, so ``packages/vllm-elastic-kv/src`` on
``PYTHONPATH`` is enough.

    python3 ci/gpu_vllm.py [--model tiny|1b|8b|gptoss|mla|gdn|moe] [--speculative ngram]
                           [--requests 256] [--prompt 256]
                           [--output 128] [--bursts 21] [--swap | --calibrate [native|elastic]]
                           [--gpu-times] [--out DIR]

Exit status 0 when every check holds, 1 otherwise. Writes ``gpu_vllm.json`` to ``--out`` (default $OUT).

This module parses the options and runs the parent; the package's other modules: ``models`` (the model
shapes and prompts), ``cpus`` (``--pin``), ``protocol`` (the children's command lines and messages),
``child`` (one engine), ``memory`` and ``timeline`` (what a child measures), ``throughput`` (the rounds),
``checks`` and ``report`` (the verdict, the summary and ``gpu_vllm.json``).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu_vllm import checks, report, throughput
from benchmarks.gpu_vllm.child import run_child
from benchmarks.gpu_vllm.cpus import cpu_split
from benchmarks.gpu_vllm.models import FAMILY_MODELS, MODELS, SPECULATIVE, model_dir
from benchmarks.gpu_vllm.protocol import SLOTS


def parse_args() -> argparse.Namespace:
    """The command line, checked for options that exclude each other."""
    parser = _parser()
    args = parser.parse_args()
    if args.swap and args.calibrate:
        parser.error("--calibrate runs one backend in both slots; --swap has nothing to swap")
    if args.gpu_times and args.cpu_smoke:
        parser.error("--gpu-times reads CUDA events: it needs a GPU")
    return args


def _parser() -> argparse.ArgumentParser:
    """The options of the parent and of the children (``--child`` and the other hidden ones)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--bursts", type=int, default=21, help="rounds: bursts per engine (median taken)")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS) + sorted(FAMILY_MODELS),
        default="tiny",
        help="model shape (random weights): Llama shapes, or another attention family (FAMILY_MODELS)",
    )
    parser.add_argument(
        "--speculative",
        choices=sorted(SPECULATIVE),
        help="both engines decode speculatively with these drafts (the elastic backend serves ngram)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.30)
    parser.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=SLOTS, help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the bursts; write profile_<slot>_<backend>.txt to --out",
    )
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the bursts")
    parser.add_argument(
        "--no-speed-goal",
        action="store_true",
        help="report the throughput ratio without checking it (a correctness run: small bursts are noise)",
    )
    parser.add_argument(
        "--gpu-times",
        action="store_true",
        help="time each burst step on the GPU (CUDA events): decode and prefill spans and the idle gaps "
        "between steps, elastic split by whether its rank was mapping (not with --cpu-smoke)",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="check this script on a CPU-only machine")
    parser.add_argument(
        "--pin", choices=["shared", "split", "none"], default="shared", help="CPU cores of the engines"
    )
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    parser.add_argument(
        "--socket", action="store_true", help="reach the worker's rank through its socket, not directly"
    )
    parser.add_argument(
        "--calibrate",
        nargs="?",
        const="native",
        choices=["native", "elastic"],
        help="A/A: two engines of one backend (native unless given), to measure what the slots differ by",
    )
    parser.add_argument(
        "--swap",
        action="store_true",
        help="elastic in the second slot (native starts first): run with and without to cancel what the "
        "slots themselves differ by",
    )
    parser.add_argument(
        "--shared-caches",
        dest="own_caches",
        action="store_false",
        help="let the engines share vLLM's, inductor's and Triton's caches (by default each has its own)",
    )
    parser.add_argument(
        "--cache-root",
        help="keep each slot's compile caches under this folder, for the next run (default: a fresh one)",
    )
    parser.add_argument(
        "--random-layout",
        dest="same_layout",
        action="store_false",
        help="keep address-space randomization and random hash seeds (by default both engines run without)",
    )
    return parser


def main() -> None:
    """Run the proof (or, with ``--child``, one of its engines); exits 1 when a check fails."""
    args = parse_args()
    if args.child:
        if args.cpus:  # before vLLM and torch start their threads: they inherit it
            os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
        run_child(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    _prepare(args)
    native, elastic, rounds = throughput.measure(args)
    ratios = throughput.ratios(rounds)
    if args.calibrate:
        # Under --calibrate both slots run one backend; `elastic` is slot A (no --swap).
        print(report.calibration_line(args.calibrate, ratios, elastic, native), flush=True)
        return
    verdict = checks.evaluate(native, elastic, statistics.median(ratios), speed_goal=not args.no_speed_goal)
    print(report.summary(args, native, elastic, rounds, verdict), flush=True)
    report.write_json(args.out, native, elastic, verdict)
    sys.exit(0 if all(verdict.values()) else 1)


def _prepare(args: argparse.Namespace) -> None:
    """Pin this process's CPUs (``args.cpu_split``: the engines' too), create ``--out`` and write the model's
    config (``args.model_dir``)."""
    split = cpu_split(args.pin)
    args.cpu_split = split
    if split is not None:
        os.sched_setaffinity(0, split["parent"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.model_dir = str(model_dir(Path(tempfile.mkdtemp(prefix="ekv-gpu-")), args.model))
