"""What a replay means: SLO attainment, goodput, latency percentiles; the markdown report and the plots.

Definitions (stated in every report):

* a request *attains* the SLO when it completed with every token asked for, its TTFT is at most the TTFT
  target and its TPOT at most the TPOT target; attainment = attaining requests / all requests of the trace
  (failed and unserved requests count against it);
* goodput = attaining requests per second of the trace's span (bursts x burst size / load), and their
  output tokens per second;
* TTFT and TPOT percentiles are over the requests that completed;
* Prism's SLO (where the run measured the model alone): TTFT and TPOT each at most ``k`` times their p99
  when one model of the same shape serves one burst alone on the device (``k`` = 5 by default), per model
  and overall;
* swaps (sleep set-up): each wake of an asleep model, timed from the request that found it asleep until it
  serves -- putting other models to sleep, or suspending serving ones, to make room for it included -- from
  the server's ``/status``; suspensions (sleeps of serving models, their requests kept) and resumes (their
  wakes once room is free) are counted apart.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_kv.sizes import format_bytes

__all__ = [
    "Slo",
    "late_while_down",
    "memory_demand",
    "plot_memory",
    "prism_slo",
    "render_markdown",
    "summarize",
    "suspensions",
    "swap_times",
]

SETUP_TITLES = {
    "static": "static (native, fixed shares)",
    "elastic": "elastic (all awake, one budget)",
    "sleep": "elastic + sleep (elastic-kv serve)",
}


@dataclass(frozen=True)
class Slo:
    """Per-request targets, in seconds."""

    ttft_s: float
    tpot_s: float

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s:g} s and TPOT <= {self.tpot_s * 1000:g} ms"


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def _attains(o: Mapping[str, Any], slo: Slo) -> bool:
    return bool(o["ok"]) and o["ttft_s"] <= slo.ttft_s and o["tpot_s"] <= slo.tpot_s


def prism_slo(alone: Mapping[str, Any] | None, k: float) -> Slo | None:
    """Prism's targets: ``k`` x the TTFT and TPOT p99 of the model served alone (``None`` if not measured)."""
    if not alone or alone.get("ttft_p99_s") is None or alone.get("tpot_p99_s") is None:
        return None
    return Slo(k * alone["ttft_p99_s"], k * alone["tpot_p99_s"])


def summarize(
    outcomes: Sequence[Mapping[str, Any]], slo: Slo, span_s: float, prism: Slo | None = None
) -> dict[str, Any]:
    """The metrics of one replay from its per-request outcomes (``client.Outcome.as_dict`` rows)."""
    done = [o for o in outcomes if o["ok"]]
    good = [o for o in done if _attains(o, slo)]
    ttft = [o["ttft_s"] for o in done]
    tpot = [o["tpot_s"] for o in done]
    errors = Counter(str(o["error"]).split(":")[0] for o in outcomes if not o["ok"])
    served = sorted({o["model"] for o in outcomes if o["error"] != "not served"})
    makespan = max((o["arrival_s"] + o["latency_s"] for o in done), default=0.0)
    n = len(outcomes)

    def r(x: float | None, digits: int = 4) -> float | None:
        return None if x is None else round(x, digits)

    per_model: dict[str, dict[str, Any]] = {}
    for model in sorted({o["model"] for o in outcomes}):
        mine = [o for o in outcomes if o["model"] == model]
        row: dict[str, Any] = {
            "requests": len(mine),
            "failed": sum(not o["ok"] for o in mine),
            "slo_attainment": r(sum(_attains(o, slo) for o in mine) / len(mine)),
        }
        if prism is not None:
            row["prism_attainment"] = r(sum(_attains(o, prism) for o in mine) / len(mine))
        per_model[model] = row
    prism_good = None if prism is None else sum(_attains(o, prism) for o in outcomes)
    late = [(o["ttft_s"] > slo.ttft_s, o["tpot_s"] > slo.tpot_s) for o in done]
    return {
        "requests": n,
        "completed": len(done),
        "failed": n - len(done),
        "errors": dict(errors.most_common()),
        "models_served": len(served),
        "served": served,
        "slo_attainment": r(len(good) / n if n else 0.0),
        "goodput_rps": r(len(good) / span_s if span_s > 0 else 0.0),
        "goodput_tok_s": r(sum(o["output_tokens"] for o in good) / span_s if span_s > 0 else 0.0, 1),
        "throughput_tok_s": r(sum(o["output_tokens"] for o in done) / makespan if makespan else 0.0, 1),
        "makespan_s": r(makespan, 2),
        "ttft_p50_s": r(_pct(ttft, 50)),
        "ttft_p99_s": r(_pct(ttft, 99)),
        "tpot_p50_s": r(_pct(tpot, 50), 5),
        "tpot_p99_s": r(_pct(tpot, 99), 5),
        "prism_attainment": None if prism_good is None else r(prism_good / n if n else 0.0),
        # why the requests that did not attain the SLO missed it: only their first token was late, only
        # their decoding, both, or they failed
        "misses": {
            "ttft": sum(t and not p for t, p in late),
            "tpot": sum(p and not t for t, p in late),
            "both": sum(t and p for t, p in late),
            "failed": n - len(done),
        },
        "per_model": per_model,
    }


def down_spans(final_status: Mapping[str, Any] | None) -> dict[str, list[tuple[float, float]]]:
    """Per model, the wall-clock spans (``time.time``) in which it was not awake, from the transitions the
    sleep set-up's server recorded: before its first start, and from the beginning of each sleep, stop or
    suspension to the end of the wake, resume or start that followed (``math.inf`` while it never did)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for model in (final_status or {}).get("models", []):
        down: list[tuple[float, float]] = []
        since: float | None = -math.inf
        for t in sorted(model.get("transitions", []), key=lambda t: t["at"]):
            if t["kind"] in ("start", "wake", "resume") and since is not None:
                down.append((since, t["at"]))
                since = None
            elif t["kind"] in ("sleep", "suspend") and since is None:
                since = t["at"] - t["seconds"]
        if since is not None:
            down.append((since, math.inf))
        spans[model["name"]] = down
    return spans


def late_while_down(
    outcomes: Sequence[Mapping[str, Any]],
    slo: Slo,
    final_status: Mapping[str, Any] | None,
    start_epoch: float | None,
) -> int | None:
    """Of the requests whose first token came later than the SLO, how many waited for it while their model
    was asleep or suspended for some of the time (the others waited with their model awake throughout:
    behind its own requests). ``None`` without the server's transitions or the replay's start."""
    if not final_status or start_epoch is None:
        return None
    spans = down_spans(final_status)
    late = 0
    for o in outcomes:
        if not o["ok"] or o["ttft_s"] <= slo.ttft_s:
            continue
        begin = start_epoch + o["arrival_s"]
        end = begin + o["ttft_s"]
        late += any(a < end and begin < b for a, b in spans.get(o["model"], []))
    return late


def swap_times(final_status: Mapping[str, Any] | None) -> dict[str, list[float]]:
    """Seconds of every transition the sleep set-up's server recorded, by kind: ``wake`` (from level 1 or
    2 for a request: the swaps), ``resume`` (a suspended model's wake), ``cold`` (a wake or start that
    started a process), ``sleep`` (through the engine), ``suspend`` (a sleep while serving, its requests
    kept), ``stop`` (a sleep that stopped the process) and ``demote`` (an asleep model's level-1 copy given
    up for a model used more recently)."""
    kinds = ("wake", "resume", "cold", "sleep", "suspend", "stop", "demote")
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for model in (final_status or {}).get("models", []):
        for t in model.get("transitions", []):
            out[t["level"] if t["level"] in ("stop", "cold") else t["kind"]].append(t["seconds"])
    return out


def suspensions(final_status: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the sleep set-up's suspensions kept: how many there were, the requests their engines kept, the
    KV bytes parked in host memory at each (``parked``) and how many of those that kept requests parked
    none (their requests are computed again after the resume). ``None`` where none was recorded."""
    rows = [t for m in (final_status or {}).get("models", []) for t in m.get("transitions", [])
            if t["kind"] == "suspend"]  # fmt: skip
    if not rows:
        return None
    parked = [int(t.get("parked_bytes", 0)) for t in rows]
    kept = [int(t.get("kept", 0)) for t in rows]
    return {
        "count": len(rows),
        "kept": sum(kept),
        "parked": parked,
        "unparked": sum(1 for k, b in zip(kept, parked, strict=True) if k and not b),
    }


def memory_demand(
    outcomes: Sequence[Mapping[str, Any]],
    model_bytes: int,
    kv_bytes_per_token: int,
    tpot_s: float,
    budget_bytes: int,
    step_s: float = 0.5,
) -> dict[str, Any]:
    """What the trace asks of the device if every request were served as it arrives, as if alone: from its
    arrival for ``output_tokens`` x ``tpot_s`` (the TPOT of a model serving alone), holding the KV of its
    prompt and of the tokens generated so far, and its model's weights (``model_bytes``) resident while any
    of its requests is. Returns the peak, the seconds during which that exceeds ``budget_bytes`` and the
    requests arriving then: for those the device cannot serve everything in flight at once, whatever the
    controller does -- some request waits or decodes slower. A property of the trace and the device, not
    of the run (the outcomes give only arrivals and lengths)."""
    spans = [
        (o["arrival_s"], o["arrival_s"] + o["output_tokens"] * tpot_s, o["prompt_tokens"], o["model"])
        for o in outcomes
    ]

    def need(t: float) -> int:
        models, tokens = set(), 0.0
        for start, end, prompt, model in spans:
            if start <= t < end:
                models.add(model)
                tokens += prompt + (t - start) / tpot_s
        return len(models) * model_bytes + int(tokens * kv_bytes_per_token)

    end = max((e for _, e, _, _ in spans), default=0.0)
    needs = [need(i * step_s) for i in range(int(end / step_s) + 1)]
    peak = max(needs, default=0)
    short = step_s * sum(n > budget_bytes for n in needs)
    arriving = sum(need(start) > budget_bytes for start, _, _, _ in spans)
    return {"peak_bytes": peak, "short_s": round(short, 1), "requests_short": arriving}


def _fmt(x: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def render_markdown(results: Mapping[str, Any]) -> str:
    """The report: trace and SLO, each set-up, one table per load and the attainment curve."""
    lines = [f"# Multi-model benchmark ({results['device']})", ""]
    lines += [f"* trace: {results['trace']}", f"* SLO: {results['slo']}"]
    if results.get("prism_slo"):
        lines.append(f"* Prism's SLO: {results['prism_slo']}")
    lines += [f"* {k}: {v}" for k, v in results.get("notes", {}).items()]
    setups: dict[str, Any] = results["setups"]
    for name, setup in setups.items():
        lines.append(f"* **{SETUP_TITLES.get(name, name)}**: {setup.get('describe', '')}")
        if setup.get("skipped"):
            lines.append(f"  skipped: {setup['skipped']}")
    loads = sorted({float(x) for s in setups.values() for x in s.get("loads", {})})
    lines += ["", "## Per load", ""]
    for load in loads:
        lines += [f"### load {load:g} requests/s", ""]
        lines.append(
            "| set-up | SLO attainment | Prism SLO | goodput req/s | goodput tok/s | TTFT p50 / p99 s | "
            "TPOT p50 / p99 ms | failed | models served | peak KV |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for name, setup in setups.items():
            run = setup.get("loads", {}).get(f"{load:g}")
            if run is None:
                continue
            m = run["metrics"]
            lines.append(
                f"| {name} | {_fmt(m['slo_attainment'], 100, 1)} % | "
                f"{_fmt(m.get('prism_attainment'), 100, 1)} % | {_fmt(m['goodput_rps'], 1, 3)} | "
                f"{_fmt(m['goodput_tok_s'], 1, 0)} | {_fmt(m['ttft_p50_s'])} / {_fmt(m['ttft_p99_s'])} | "
                f"{_fmt(m['tpot_p50_s'], 1000, 1)} / {_fmt(m['tpot_p99_s'], 1000, 1)} | "
                f"{m['failed']} of {m['requests']} | {m['models_served']} of {results['models']} | "
                f"{format_bytes(int(run.get('peak_kv_bytes', 0)))} |"
            )
        lines.append("")
        lines += _misses_lines(setups, f"{load:g}")
        lines += _demand_line(setups.get("sleep", {}), f"{load:g}", results.get("alone"))
        lines += _per_model_table(setups, f"{load:g}")
    names = list(setups)
    lines += ["## SLO attainment by load", "", "| load req/s | " + " | ".join(names) + " |"]
    lines.append("|---" * (len(names) + 1) + "|")
    for load in loads:
        cells = []
        for name in names:
            run = setups[name].get("loads", {}).get(f"{load:g}")
            cells.append("-" if run is None else f"{run['metrics']['slo_attainment'] * 100:.1f} %")
        lines.append(f"| {load:g} | " + " | ".join(cells) + " |")
    swaps = swap_times(setups.get("sleep", {}).get("final_status"))
    if any(swaps.values()):
        lines += ["", "## Sleep set-up: transitions over the whole run", ""]
        lines += ["| transition | count | p50 s | p99 s | max s |", "|---|---|---|---|---|"]
        titles = {"wake": "swap (wake from level 1/2, room made included)", "cold": "cold start",
                  "resume": "resume (a suspended model's wake)", "sleep": "sleep (level 1/2)",
                  "suspend": "suspend (sleep while serving, requests kept)",
                  "stop": "sleep by stopping", "demote": "demote (asleep, level 1 to 2)"}  # fmt: skip
        for kind, values in swaps.items():
            if values:
                lines.append(
                    f"| {titles[kind]} | {len(values)} | {_fmt(_pct(values, 50))} | "
                    f"{_fmt(_pct(values, 99))} | {_fmt(max(values))} |"
                )
    kept = suspensions(setups.get("sleep", {}).get("final_status"))
    if kept is not None:
        parked = kept["parked"]
        lines += ["", (
            f"Suspensions: {kept['count']}, keeping {kept['kept']} requests; KV parked in host memory "
            f"{format_bytes(sum(parked))} in all (p50 {format_bytes(int(_pct(parked, 50) or 0))}, max "
            f"{format_bytes(max(parked))} a suspension); {kept['unparked']} kept requests but parked no KV "
            "(those requests are computed again after the resume)."
        )]  # fmt: skip
    plots = results.get("plots", [])
    if plots:
        lines += ["", "KV memory per model over time: " + ", ".join(f"`{p}`" for p in plots)]
    return "\n".join(lines) + "\n"


def _misses_lines(setups: Mapping[str, Any], key: str) -> list[str]:
    """Per set-up, why its requests missed the SLO (results written before ``misses`` have none)."""
    lines = []
    for name, setup in setups.items():
        misses = setup.get("loads", {}).get(key, {}).get("metrics", {}).get("misses")
        if misses and any(misses.values()):
            line = (
                f"* {name} missed the SLO: {misses['ttft']} by TTFT only, {misses['tpot']} by TPOT only, "
                f"{misses['both']} by both, {misses['failed']} failed"
            )
            if misses.get("ttft_while_down") is not None and misses["ttft"] + misses["both"]:
                line += (
                    f"; of the {misses['ttft'] + misses['both']} first tokens late, "
                    f"{misses['ttft_while_down']} waited while their model was asleep or suspended, the "
                    f"others while it was awake throughout"
                )
            lines.append(line)
    return [*lines, ""] if lines else []


def _demand_line(setup: Mapping[str, Any], key: str, alone: Mapping[str, Any] | None) -> list[str]:
    """The sleep set-up's :func:`memory_demand` at one load, in words (nothing where the run lacks the
    sizes, the budget or the TPOT served alone)."""
    run = setup.get("loads", {}).get(key)
    tpot = (alone or {}).get("tpot_p50_s")
    if not run or not tpot or "model_bytes" not in setup:
        return []
    budget = setup["budget_bytes"]
    d = memory_demand(run["outcomes"], setup["model_bytes"], setup["kv_bytes_per_token"], tpot, budget)
    return [
        f"Served as it arrives, as if alone (TPOT {tpot * 1000:.1f} ms), the trace would need up to "
        f"{format_bytes(d['peak_bytes'])} (the weights of every model with a request in flight, and their "
        f"KV) against the sleep set-up's budget of {format_bytes(budget)}; it needs more for "
        f"{d['short_s']:g} s, in which {d['requests_short']} of {len(run['outcomes'])} requests arrive: "
        "there some request must wait or decode slower, whatever the controller does.",
        "",
    ]


def _per_model_table(setups: Mapping[str, Any], key: str) -> list[str]:
    """Per model: requests, failed, SLO and Prism attainment of every set-up at one load."""
    runs = {n: s["loads"][key]["metrics"] for n, s in setups.items() if key in s.get("loads", {})}
    models = sorted({m for r in runs.values() for m in r.get("per_model", {})}, key=lambda m: (len(m), m))
    if not models:
        return []
    head = " | ".join(f"{n}: SLO / Prism" for n in runs)
    lines = [f"| model | requests | {head} |", "|---" * (len(runs) + 2) + "|"]
    for model in models:
        cells, count = [], 0
        for metrics in runs.values():
            row = metrics.get("per_model", {}).get(model)
            if row is None:
                cells.append("-")
                continue
            count = row["requests"]
            cells.append(
                f"{_fmt(row['slo_attainment'], 100, 0)} / {_fmt(row.get('prism_attainment'), 100, 0)} %"
                + (f" ({row['failed']} failed)" if row["failed"] else "")
            )
        lines.append(f"| {model} | {count} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _mark_transitions(ax: Any, samples: Sequence[Mapping[str, Any]], colors: Mapping[str, Any]) -> None:
    """Vertical lines where a model starts waking (dotted) or falls asleep (dashed), in its colour."""
    previous: dict[str, str] = {}
    for sample in samples:
        for model, state in sample.get("state", {}).items():
            before = previous.get(model)
            if before is not None and state != before and state in ("waking", "asleep"):
                ax.axvline(sample["t"], color=colors[model], ls=":" if state == "waking" else "--", lw=1.0)
            previous[model] = state


def plot_memory(results: Mapping[str, Any], out_dir: Path) -> list[str]:
    """One PNG per load (``kv_memory_load<L>.png``): KV bytes per model over time (stacked), one panel per
    set-up, the device budget dashed, burst starts marked on the time axis, and in the sleep set-up's
    panel each model's wakes (dotted) and sleeps (dashed). Returns the file names ([] without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    setups = {k: v for k, v in results["setups"].items() if v.get("loads")}
    loads = sorted({float(x) for s in setups.values() for x in s["loads"]})
    names: list[str] = results["model_names"]
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(names)}
    peak = max(
        (
            sum(x["kv"].values())
            for s in setups.values()
            for r in s["loads"].values()
            for x in r.get("memory", [])
        ),
        default=0,
    )
    peak = max([peak, *(r.get("budget_bytes", 0) for s in setups.values() for r in s["loads"].values())])
    hosts = [x.get("host") or 0 for s in setups.values() for r in s["loads"].values() for x in r["memory"]]
    peak = max([peak, *hosts])
    unit, scale = ("GiB", 2**-30) if peak >= 2**30 else ("MiB", 2**-20)
    files = []
    for load in loads:
        key = f"{load:g}"
        panels = [(n, s["loads"][key]) for n, s in setups.items() if key in s["loads"]]
        fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels)), sharex=True, squeeze=False)
        for ax, (setup, run) in zip(axes[:, 0], panels, strict=True):
            samples = run.get("memory", [])
            t = [s["t"] for s in samples]
            stacks = [[s["kv"].get(model, 0) * scale for s in samples] for model in names]
            if t:
                ax.stackplot(
                    t, stacks, labels=names, colors=[colors[m] for m in names], step="post", alpha=0.85
                )
            if run.get("budget_bytes"):
                ax.axhline(run["budget_bytes"] * scale, color="black", ls="--", lw=0.8, label="budget")
            host = [s.get("host") for s in samples]
            if any(h is not None for h in host):
                ax.step(t, [(h or 0) * scale for h in host], where="post", color="dimgray", lw=1.2,
                        label="host: asleep weights")  # fmt: skip
            _mark_transitions(ax, samples, colors)
            for start, model in zip(run["burst_starts_s"], run["burst_models"], strict=True):
                ax.plot(
                    [start], [0], marker="^", color=colors[names[model]], ms=7, clip_on=False, mec="black"
                )
            m = run["metrics"]
            title = SETUP_TITLES.get(setup, setup)
            ax.set_title(f"{title}: SLO attainment {m['slo_attainment'] * 100:.1f} %", fontsize=10)
            ax.set_ylabel(f"KV {unit} (stacked)" if all(h is None for h in host) else unit)
            ax.set_ylim(0, peak * scale * 1.08 if peak else 1)
            ax.grid(alpha=0.3)
        axes[0, 0].legend(loc="upper right", fontsize=7, ncol=min(4, len(names) + 1))
        axes[-1, 0].set_xlabel(f"seconds (load {load:g} requests/s; triangles: burst starts, by model)")
        fig.tight_layout()
        name = f"kv_memory_load{key}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        files.append(name)
    swaps = swap_times(results["setups"].get("sleep", {}).get("final_status"))
    if any(swaps.values()):
        fig, ax = plt.subplots(figsize=(8, 3.2))
        edges = [0.0, *(2.0**e for e in range(-4, 8))]
        kinds = (("wake", "tab:green"), ("resume", "tab:olive"), ("sleep", "tab:blue"),
                 ("suspend", "tab:purple"), ("cold", "tab:red"))  # fmt: skip
        for kind, color in kinds:
            if swaps[kind]:
                ax.hist(swaps[kind], bins=edges, alpha=0.6, color=color, label=f"{kind} ({len(swaps[kind])})")
        ax.set_xscale("symlog", linthresh=0.0625)
        ax.set_xlabel("seconds (wake: a swap, room made for it included)")
        ax.set_ylabel("transitions")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "swap_times.png", dpi=110)
        plt.close(fig)
        files.append("swap_times.png")
    return files
