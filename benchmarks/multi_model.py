"""Many models on one device: one seeded trace replayed against static partitioning, elastic KV and sleep.

Three set-ups, side by side in one run, each started once and fed every load of the sweep in turn
(``benchmarks/multimodel/setups.py``):

1. ``static``  -- native vLLM engines, each with a fixed share of the device (1/N), as many as fit;
2. ``elastic`` -- the same engines with ``--kv-cache-backend=elastic``, all awake, one device budget;
3. ``sleep``   -- ``elastic-kv serve --config`` with sleep/wake and more models than fit awake at once
   (skipped, with one line, where the ``elastic_kv_serve`` package is not installed).

The trace (``benchmarks/multimodel/trace.py``): N models, bursts of requests to one model at a time, gamma
gaps between bursts with a coefficient of variation >= 2, Zipf popularity, uniform prompt and output
lengths, one seed. The client streams completions and measures TTFT and TPOT per request
(``multimodel/client.py``). Per set-up and load the report gives SLO attainment (targets stated),
goodput, p50/p99 TTFT and TPOT, failed requests, models served and KV memory per model over time (a PNG
per load), then the attainment curve over the loads.

Where elastic wins, and why the defaults are what they are. The gain comes from KV capacity: a
decode-heavy burst on one model needs more KV than its static 1/N share while its neighbours idle; an
elastic engine grows into their memory and runs the whole burst as one batch, a static one queues or
preempts. On the H200 a burst of 256 requests x (1,000 prompt + 2,000 output) tokens on Llama-3-8B's shape
took 77.2 s on a static 1/3 share and 56.9 s on an elastic engine; a prefill-bound burst (3,000 + 200)
gained nothing (28.5 s vs 27.3 s), since prefill is compute-bound and its KV is short-lived. So the
defaults are decode-heavy bursts (outputs about twice the prompts) whose KV exceeds a static share but
fits the device: on CUDA 128 requests x (500-1,500 + 1,000-3,000) tokens per burst (about 48 GiB of KV at
the end of a burst against about 25 GiB per static 1/3 share), on the CPU 12 requests x (64-192 +
128-384) tokens against a 4 MiB share of a 12 MiB KV total. The loads sweep from bursts that rarely
overlap (elastic's best case: one model busy, the others idle) to bursts that pile up on several models
(where every set-up is capacity-bound and the gap closes). With N = 6 or more 8B models on an H200 static
shares hold little KV each (or the models do not all fit) and model count binds: that is the sleep
set-up's case.

    python benchmarks/multi_model.py --device cpu --out DIR            # tiny local models, relative numbers
    python benchmarks/multi_model.py --device cuda --out DIR [--models 6]   # H200: 8B-shape weights
    python benchmarks/multi_model.py --out DIR --report-only           # rebuild report and plots from DIR

``--setups static,elastic,sleep`` picks set-ups and ``--loads`` the loads; each set-up's results go to
``DIR/<setup>.json`` after every load, and a later run into the same DIR with the same trace adds its
loads there, so a sweep can be split over several calls (the GPU machine runs one command for at most 10
minutes: a set-up takes its engines' start-up, about a minute per 8B engine one at a time, plus per load
its span, bursts x burst size / load, plus the last burst's decode). The report covers every set-up
found in DIR. On CUDA the elastic budget is the KV the static engines had (``DIR/static.json``) unless
``--kv-total`` gives it. Writes ``DIR/results.json``, ``DIR/report.md``, ``DIR/kv_memory_load<L>.png``
(where matplotlib is installed; else ``--report-only`` draws them later), ``DIR/trace.json``, the sleep
set-up's ``DIR/models.toml`` and engine logs under ``DIR/logs``. The GPU procedure: ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.multimodel.client import replay  # noqa: E402
from benchmarks.multimodel.engines import ModelShape, dummy_llama, random_llama, tiny_llama  # noqa: E402
from benchmarks.multimodel.report import (  # noqa: E402
    Slo,
    late_while_down,
    plot_memory,
    prism_slo,
    render_markdown,
    summarize,
)
from benchmarks.multimodel.setups import (  # noqa: E402
    ElasticSetup,
    Plan,
    SleepSetup,
    StaticSetup,
    serve_available,
)
from benchmarks.multimodel.trace import TraceSpec, build_trace  # noqa: E402

logger = logging.getLogger("multi_model")

SETUPS = ("static", "elastic", "sleep")
# Per device: trace, SLO and sizes (see the module docstring for why).
DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {
        "models": 3,
        "loads": "0.5,1,2",
        "bursts": 6,
        "burst_size": 12,
        "burst_spread": 1.0,
        "prompt": "64:192",
        "output": "128:384",
        "ttft_slo": 5.0,
        "tpot_slo": 0.25,
        "kv_total": "12M",
        "max_model_len": 1024,
        "idle_sleep": 20.0,
        "start_parallel": 2,
        "start_timeout": 600.0,
        "sample_period": 0.25,
        "settle": 3.0,
        "host_budget": None,
        "preload": False,
    },
    "cuda": {
        "models": 3,
        "loads": "2,4,8",
        "bursts": 3,
        "burst_size": 128,
        "burst_spread": 2.0,
        "prompt": "500:1500",
        "output": "1000:3000",
        "ttft_slo": 10.0,
        "tpot_slo": 0.1,
        "kv_total": None,
        "max_model_len": 4608,
        "idle_sleep": 10.0,
        "start_parallel": 4,
        "start_timeout": 900.0,
        "sample_period": 0.5,
        "settle": 5.0,
        "host_budget": "60%",  # 5 copies of an 8B model's weights: 4 asleep and 1 spare (serve's README)
        "preload": True,
    },
}


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI tokens, got {text!r}") from None


def _serve_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for the sleep set-up's ``[server]`` table, VALUE read as TOML (``0.5``, ``"8G"``)."""
    import tomllib

    key, sep, value = text.partition("=")
    try:
        if not sep or not key.strip():
            raise ValueError
        return key.strip(), tomllib.loads(f"v = {value.strip()}")["v"]
    except (ValueError, tomllib.TOMLDecodeError):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (a TOML value), got {text!r}") from None


def _loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected loads such as 0.5,1,2, got {text!r}") from None
    if not loads or any(x <= 0 for x in loads):
        raise argparse.ArgumentTypeError(f"loads must be > 0 requests/s, got {text!r}")
    return sorted(loads)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--device", choices=("cpu", "cuda"), help="cpu (default) or cuda; --report-only: the run's"
    )
    p.add_argument("--out", type=Path, required=True, help="directory for results, plots, logs")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated: static,elastic,sleep")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from --out, run nothing")
    p.add_argument("--models", type=int, help="N models (cpu 3, cuda 3; 6+ makes model count bind)")
    p.add_argument("--loads", type=_loads, help="mean requests/s to sweep (cpu 0.5,1,2; cuda 2,4,8)")
    p.add_argument("--bursts", type=int, help="bursts per trace (cpu 6, cuda 3)")
    p.add_argument("--burst-size", type=int, help="requests per burst (cpu 12, cuda 128)")
    p.add_argument("--burst-spread", type=float, help="a burst's arrivals spread over this many seconds")
    p.add_argument("--cv", type=float, default=3.0, help="CV of the gamma gaps between bursts (>= 2)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of model popularity")
    p.add_argument("--cover", action="store_true", help="every model gets at least one burst")
    p.add_argument("--prompt", type=_range, help="prompt tokens LO:HI, uniform (cpu 64:192, cuda 500:1500)")
    p.add_argument("--output", type=_range, help="output tokens LO:HI, uniform (cpu 128:384, cuda 1000:3000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, help="TTFT target, s (cpu 5, cuda 10)")
    p.add_argument("--tpot-slo", type=float, help="TPOT target, s (cpu 0.25, cuda 0.1)")
    p.add_argument("--kv-total", help="KV memory the models share (cpu 12M; cuda: static's, measured)")
    p.add_argument("--gpu-share", type=float, default=0.9, help="cuda: part of the GPU the models may use")
    p.add_argument("--engine-overhead", default=None, help="per engine beside weights+KV (cpu 0, cuda 3G)")
    p.add_argument("--awake", type=int, help="cpu sleep set-up: models that fit awake at once (N-1)")
    p.add_argument("--idle-sleep", type=float, help="sleep set-up: idle seconds before a model sleeps")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine argument (repeatable)")
    p.add_argument("--cuda-graphs", action="store_true", help="cuda: keep CUDA graphs (default eager)")
    p.add_argument(
        "--start-parallel", type=int, help="engines started at once (cpu 2, cuda 4; static on cuda: 1)"
    )
    p.add_argument("--host-budget", help="sleep set-up: host memory for asleep weights (cuda 60%%)")
    p.add_argument(
        "--serve-option",
        type=_serve_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sleep set-up: one more [server] setting of elastic-kv serve, e.g. kv_share_min_weights=0.5",
    )
    p.add_argument(
        "--host-arena-dir", type=Path, help="sleep set-up: the arena's directory (/dev/shm if room)"
    )
    p.add_argument(
        "--preload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sleep set-up: start every model at start-up (cuda yes, cpu no)",
    )
    p.add_argument(
        "--weights",
        choices=("dummy", "random"),
        help="cuda: --load-format dummy, or a random checkpoint written once beside --out, which level-2 "
        "sleeps can reload (default: random with the sleep set-up, else dummy)",
    )
    p.add_argument("--prism-k", type=float, default=5.0, help="Prism SLO: k x p99 served alone (0: off)")
    p.add_argument("--start-timeout", type=float, help="seconds an engine may take to start")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--sample-period", type=float, help="seconds between KV memory samples")
    p.add_argument("--settle", type=float, help="idle seconds between loads")
    p.add_argument(
        "--time-limit", type=float, help="seconds per set-up; loads that would pass it are left out"
    )
    args = p.parse_args(argv)
    saved = args.out / "trace.json"
    if args.device is None:
        args.device = (
            json.loads(saved.read_text())["device"] if args.report_only and saved.exists() else "cpu"
        )
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(
                args,
                key,
                _loads(value) if key == "loads" else _range(value) if key in ("prompt", "output") else value,
            )
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown:
        p.error(f"--setups: unknown set-up {unknown[0]!r} (choose from {', '.join(SETUPS)})")
    if args.weights is None:
        args.weights = "random" if "sleep" in args.setups else "dummy"
    if args.awake is None:
        args.awake = max(1, args.models - 1)
    return args


def _gpu_total() -> int:
    """GPU 0's memory in bytes, from ``nvidia-smi`` (this process creates no CUDA context)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(float(out.stdout.strip().splitlines()[0])) << 20


def build_plan(args: argparse.Namespace) -> Plan:
    from elastic_kv.sizes import parse_size

    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = [f"m{i}" for i in range(args.models)]
    eager = [] if args.device == "cuda" and args.cuda_graphs else ["--enforce-eager"]
    if args.device == "cpu":
        model_dir, dtype, dtype_bytes, gpu_total = tiny_llama(), "float32", 4, 0
        load = []
    else:
        dtype, dtype_bytes, gpu_total = "bfloat16", 2, _gpu_total()
        if args.weights == "random":  # shared by the runs beside this one (--out's parent)
            model_dir, load = random_llama(args.out.parent / "model"), []
        else:
            model_dir, load = dummy_llama(args.out / "model"), ["--load-format", "dummy"]
    engine_args = [
        "--dtype",
        dtype,
        "--max-model-len",
        str(args.max_model_len),
        *eager,
        *load,
        *args.engine_arg,
    ]
    overhead = args.engine_overhead or ("0" if args.device == "cpu" else "3G")
    arena_dir = args.host_arena_dir
    if arena_dir is None and args.device == "cuda" and args.host_budget is not None:
        arena_dir = _arena_dir(args.host_budget)
    kv_total = args.kv_total
    if kv_total is None and args.device == "cuda" and (args.out / "static.json").exists():
        kv_total = json.loads((args.out / "static.json").read_text())["kv_total_bytes"] or None
        kv_total = str(kv_total) if kv_total else None
    return Plan(
        device=args.device,
        model_dir=model_dir,
        shape=ModelShape.read(model_dir, dtype_bytes),
        names=names,
        engine_args=engine_args,
        max_model_len=args.max_model_len,
        kv_total=parse_size(kv_total) if kv_total else None,
        gpu_total=gpu_total,
        gpu_share=args.gpu_share,
        overhead=parse_size(overhead),
        awake=args.awake,
        idle_sleep_s=args.idle_sleep,
        start_parallel=args.start_parallel,
        start_timeout_s=args.start_timeout,
        logs=logs,
        host_budget=args.host_budget,
        serve_options=dict(args.serve_option),
        host_arena_dir=arena_dir,
        preload=args.preload,
    )


def _arena_dir(host_budget: str) -> Path | None:
    """``/dev/shm`` where that memory file system holds the host budget (a container's is often small);
    else ``None`` (the server puts the arena beside its registry)."""
    import os

    import psutil
    from elastic_kv.sizes import Percent, parse_amount

    amount = parse_amount(host_budget)
    need = amount.of(int(psutil.virtual_memory().total)) if isinstance(amount, Percent) else amount
    shm = Path("/dev/shm")
    if shm.is_dir():
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize >= need:
            return shm
    logger.warning(
        "/dev/shm has no room for a host budget of %s: the arena goes beside the registry", host_budget
    )
    return None


def _spec(args: argparse.Namespace) -> TraceSpec:
    return TraceSpec(
        models=args.models,
        bursts=args.bursts,
        burst_size=args.burst_size,
        burst_spread_s=args.burst_spread,
        prompt=args.prompt,
        output=args.output,
        cv=args.cv,
        zipf_s=args.zipf,
        seed=args.seed,
        cover=args.cover,
    )


def _warm_up(endpoints: dict[str, str], names: list[str], timeout_s: float) -> None:
    """One short completion per model of ``names`` that has an endpoint (first-request costs stay out of
    the measurement)."""
    import httpx

    for name in names:
        url = endpoints.get(name)
        if url is None:
            continue
        body = {"model": name, "prompt": [16, 17, 18, 19], "max_tokens": 4, "temperature": 0.0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s, trust_env=False)
        if reply.status_code != 200:
            raise RuntimeError(f"warm-up of {name} failed: HTTP {reply.status_code}: {reply.text[:200]}")


ALONE_OUTPUT_TOKENS = 128  # the calibration burst's outputs: enough steps for a stable TPOT, a short run


def measure_alone(setup: Any, plan: Plan, args: argparse.Namespace, spec: TraceSpec) -> None:
    """Prism's reference: one burst of the trace's size and prompt lengths (outputs of at most
    ``ALONE_OUTPUT_TOKENS``) to one awake model while every other model idles; its TTFT and TPOT
    percentiles go to ``--out/alone.json``. Measured once per ``--out`` (every model has the same shape)."""
    path = args.out / "alone.json"
    if args.prism_k <= 0 or (path.exists() and json.loads(path.read_text()).get("trace") == spec.describe()):
        return
    awake = setup.awake_models() if hasattr(setup, "awake_models") else list(setup.endpoints)
    if not awake:
        logger.warning("%s: no awake model to measure alone", setup.name)
        return
    cap = min(spec.output[1], ALONE_OUTPUT_TOKENS)
    solo = TraceSpec(
        models=1, bursts=1, burst_size=spec.burst_size, burst_spread_s=spec.burst_spread_s,
        prompt=spec.prompt, output=(min(spec.output[0], cap), cap), seed=spec.seed + 1,
    )  # fmt: skip
    rows = [
        o.as_dict()
        for o in replay(
            build_trace(solo, 1.0), setup.endpoints, [awake[0]], plan.shape.vocab_size, args.request_timeout
        )
    ]
    metrics = summarize(rows, Slo(float("inf"), float("inf")), 1.0)
    record = {
        "trace": spec.describe(),
        "model": awake[0],
        "setup": setup.name,
        "burst": solo.describe(),
        **{
            k: metrics[k]
            for k in ("requests", "failed", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
        },
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    logger.info("%s: %s alone: %s", setup.name, awake[0], json.dumps(record))


def _replay_load(
    setup: Any, plan: Plan, args: argparse.Namespace, spec: TraceSpec, load: float
) -> dict[str, Any]:
    """Replay the trace at ``load`` against a running set-up; the load's record (metrics added later)."""
    trace = build_trace(spec, load)
    sampler = setup.sampler(args.sample_period) if hasattr(setup, "sampler") else None
    step = max(1, len(trace.requests) // 10)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            logger.info("%s load %g: %d/%d requests done", setup.name, load, done, total)

    started: list[float] = []  # the replay's start on the wall clock, which the server's transitions use

    def on_start(start: float) -> None:
        started.append(time.time() + start - time.perf_counter())
        if sampler is not None:
            sampler.start(start)

    logger.info("%s load %g: %d requests over %.0f s", setup.name, load, len(trace.requests), trace.span_s)
    outcomes = replay(
        trace,
        setup.endpoints,
        plan.names,
        plan.shape.vocab_size,
        args.request_timeout,
        on_start=on_start,
        on_progress=progress,
    )
    rows = [o.as_dict() for o in outcomes]
    if sampler is not None:
        memory, budget = sampler.stop(), sampler.budget_bytes
    else:  # static: each engine's KV cache is allocated once, at its fixed size
        end = max((o["arrival_s"] + (o["latency_s"] or 0.0) for o in rows), default=0.0)
        kv = {name: setup.kv_bytes.get(name, 0) for name in plan.names}
        memory, budget = [{"t": 0.0, "kv": kv}, {"t": round(end, 3), "kv": kv}], 0
    return {
        **trace.as_dict(),
        "peak_kv_bytes": max((sum(s["kv"].values()) for s in memory), default=0),
        "budget_bytes": budget,
        "memory": memory,
        "outcomes": rows,
        "start_epoch": started[0] if started else None,
    }


def run_setup(setup: Any, plan: Plan, args: argparse.Namespace, spec: TraceSpec, slo: Slo) -> dict[str, Any]:
    """Start ``setup``, replay every load, stop it; the set-up's record.

    ``<name>.json`` in ``--out`` is rewritten after every load (a run cut short keeps the loads it
    finished); loads recorded there by an earlier run of the same trace stay unless replayed now.
    With ``--time-limit``, a load whose span would end past the limit is left out (logged).
    """
    path = args.out / f"{setup.name}.json"
    record: dict[str, Any] = {"loads": {}}
    if path.exists():
        earlier = json.loads(path.read_text())
        if earlier.get("trace") == spec.describe():
            record["loads"] = earlier.get("loads", {})
    record["trace"] = spec.describe()
    t0 = time.monotonic()
    try:
        setup.start()
        logger.info("%s: up in %.0f s: %s", setup.name, time.monotonic() - t0, setup.describe)
        record.update(setup.info())
        # The sleep set-up warms only the models awake after its start-up: waking the others is its cost.
        warm = setup.awake_models() if hasattr(setup, "awake_models") else plan.names
        _warm_up(setup.endpoints, warm, args.request_timeout)
        measure_alone(setup, plan, args, spec)
        prism = prism_slo(_alone(args.out), args.prism_k)
        for load in args.loads:
            span = build_trace(spec, load).span_s
            if args.time_limit and time.monotonic() - t0 + span > args.time_limit:
                logger.warning(
                    "%s load %g: left out (its %.0f s span would pass --time-limit)", setup.name, load, span
                )
                continue
            run = _replay_load(setup, plan, args, spec, load)
            run["metrics"] = summarize(run["outcomes"], slo, run["span_s"], prism)
            record["loads"][f"{load:g}"] = run
            path.write_text(json.dumps(record) + "\n")
            headline = {k: run["metrics"][k] for k in _HEADLINE}
            logger.info("%s load %g: %s", setup.name, load, json.dumps(headline))
            time.sleep(args.settle)
    finally:
        record.update(setup.info())
        setup.stop()
        path.write_text(json.dumps(record) + "\n")
    return record


_HEADLINE = (
    "slo_attainment",
    "prism_attainment",
    "goodput_rps",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "failed",
    "models_served",
)


def _alone(out: Path) -> dict[str, Any] | None:
    path = out / "alone.json"
    return json.loads(path.read_text()) if path.exists() else None


def build_report(args: argparse.Namespace, slo: Slo, spec: TraceSpec) -> dict[str, Any]:
    """Combine every ``<setup>.json`` in ``--out`` (metrics recomputed with this run's SLO)."""
    alone = _alone(args.out)
    prism = prism_slo(alone, args.prism_k)
    setups: dict[str, Any] = {}
    for name in SETUPS:
        path = args.out / f"{name}.json"
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        for run in record.get("loads", {}).values():
            run["metrics"] = summarize(run["outcomes"], slo, run["span_s"], prism)
            down = late_while_down(run["outcomes"], slo, record.get("final_status"), run.get("start_epoch"))
            if down is not None:
                run["metrics"]["misses"]["ttft_while_down"] = down
        setups[name] = record
    results: dict[str, Any] = {
        "device": args.device,
        "models": spec.models,
        "model_names": [f"m{i}" for i in range(spec.models)],
        "trace": spec.describe(),
        "slo": slo.describe(),
        "setups": setups,
    }
    if prism is not None and alone is not None:
        results["prism_slo"] = (
            f"{prism.describe()} ({args.prism_k:g} x the p99 of {alone['model']} serving one burst alone "
            f"in the {alone['setup']} set-up: TTFT {alone['ttft_p99_s']:.3f} s, "
            f"TPOT {alone['tpot_p99_s'] * 1000:.1f} ms)"
        )
        results["alone"] = alone
    results["plots"] = plot_memory(results, args.out)
    (args.out / "report.md").write_text(render_markdown(results))
    slim = json.loads(json.dumps(results))
    for record in slim["setups"].values():
        for run in record.get("loads", {}).values():
            run.pop("outcomes", None)
    (args.out / "results.json").write_text(json.dumps(slim, indent=1) + "\n")
    return results


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every set-up's stop(): no engine is left behind


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    spec, slo = _spec(args), Slo(args.ttft_slo, args.tpot_slo)
    if args.report_only:
        saved = json.loads((args.out / "trace.json").read_text())["spec"]
        spec = TraceSpec(**{**saved, "prompt": tuple(saved["prompt"]), "output": tuple(saved["output"])})
    else:
        (args.out / "trace.json").write_text(
            json.dumps({"device": args.device, "spec": spec.__dict__, "loads": args.loads}, indent=1) + "\n"
        )
        plan = build_plan(args)
        for name in args.setups:
            if name == "sleep" and not serve_available():
                print("sleep: skipped: elastic-kv serve is not installed (packages/elastic-kv-serve)")
                if not (args.out / "sleep.json").exists():
                    (args.out / "sleep.json").write_text(
                        json.dumps({"skipped": "elastic-kv serve is not installed"})
                    )
                continue
            if name == "elastic" and plan.kv_total is None:
                print(
                    "elastic: skipped: no KV total (run --setups static into this --out, or give --kv-total)"
                )
                continue
            setup: Any
            if name == "static":
                setup = StaticSetup(plan)
            elif name == "elastic":
                setup = ElasticSetup(plan)
            else:
                setup = SleepSetup(plan, args.out / "models.toml")
            record = run_setup(setup, plan, args, spec, slo)
            if name == "static" and plan.kv_total is None:
                plan.kv_total = record["kv_total_bytes"]
    results = build_report(args, slo, spec)
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
