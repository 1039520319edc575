"""``kvctl top``: a live table of every pool and device budget, drawn with ``rich``.

Each device gets a bar of what its pools have charged against its budget (or its size), each pool a bar
of its charge against its limit, so an operator sees at a glance which engine holds the memory and which
one is pressed against its limit.
"""

from __future__ import annotations

import time
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from elastic_kv.cli.table import device_cells, pool_cells
from elastic_kv.registry import UNLIMITED, DeviceInfo, PoolInfo, Registry

__all__ = ["render_top", "run_top"]

_BAR_WIDTH = 16


def _bar(used: int, whole: int) -> ProgressBar | Text:
    if whole <= 0:
        return Text("-", style="dim")
    return ProgressBar(total=float(whole), completed=float(min(used, whole)), width=_BAR_WIDTH)


def _latency(pool: PoolInfo, op: str) -> str:
    for histogram in pool.latency:
        if histogram.op == op and histogram.count:
            p50, p99 = histogram.quantile(0.5), histogram.quantile(0.99)
            return f"{_seconds(p50)}/{_seconds(p99)}"
    return "-"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return ">1s"
    return f"≤{value * 1e6:.0f}µs" if value < 1e-3 else f"≤{value * 1e3:.0f}ms"


def _device_table(devices: list[DeviceInfo]) -> Table:
    table = Table(title="devices", title_justify="left", expand=False)
    columns = ("device", "budget", "charged", "", "size", "pools")
    for column in columns:
        table.add_column(column, justify="left" if column in ("device", "") else "right")
    for d in devices:
        whole = d.budget_bytes if d.budget_bytes != UNLIMITED else d.total_bytes
        cells = device_cells(d)
        table.add_row(*(_bar(d.charged_bytes, whole) if c == "" else cells[c] for c in columns))
    return table


def _pool_table(pools: list[PoolInfo]) -> Table:
    table = Table(title="pools", title_justify="left", expand=False)
    right = {"pid", "limit", "charged", "mapped", "reserve", "blocks", "hit"}
    columns = ("pool", "device", "engine", "model", "pid", "limit", "charged", "", "mapped", "reserve",
               "blocks", "hit", "map p50/p99", "state")  # fmt: skip
    for column in columns:
        table.add_column(
            column,
            justify="right" if column in right else "left",
            no_wrap=True,
            overflow="ellipsis",
            max_width=28 if column == "model" else None,
        )
    for p in pools:
        cells: dict[str, str | ProgressBar | Text] = {**pool_cells(p)}
        state = cells["state"]
        cells[""] = _bar(p.charged_bytes, p.limit_bytes)
        cells["map p50/p99"] = _latency(p, "map")
        cells["state"] = Text(
            str(state), style="red" if state == "inconsistent" else "yellow" if state == "shrinking" else ""
        )
        table.add_row(*(cells[c] for c in columns))
    return table


def render_top(registry: Registry) -> Group:
    """One frame of ``kvctl top``: the device table above the pool table."""
    pools = registry.pools()
    devices = registry.devices(reclaim=False)
    stamp = Text(f"elastic-kv  {time.strftime('%H:%M:%S')}  {registry.directory}", style="bold")
    if not pools and not devices:
        return Group(stamp, Text("no elastic-kv pools"))
    return Group(stamp, _device_table(devices), _pool_table(pools))


def run_top(registry: Registry, *, interval: float, count: int | None, out: TextIO) -> None:
    """Redraw every ``interval`` seconds until Ctrl-C, or ``count`` frames (then leave the last one)."""
    console = Console(file=out)
    frames = 0
    try:
        with Live(render_top(registry), console=console, auto_refresh=False, transient=False) as live:
            frames = 1
            while count is None or frames < count:
                time.sleep(interval)
                live.update(render_top(registry), refresh=True)
                frames += 1
    except KeyboardInterrupt:
        pass
