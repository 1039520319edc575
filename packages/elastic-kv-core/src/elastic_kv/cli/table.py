"""What ``kvctl list`` and ``kvctl top`` show of a pool and a device: the cells of one row, by column.

:func:`pool_cells` and :func:`device_cells` turn what the registry read into text, one cell per column of
:data:`POOL_COLUMNS` and :data:`DEVICE_COLUMNS`; :func:`render_list` lays them out as the plain-text tables
of ``kvctl list``, and ``kvctl top`` (:mod:`.top`) puts the same cells into its live table beside its bars.
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic_kv.registry import UNLIMITED, DeviceInfo, PoolInfo
from elastic_kv.sizes import format_bytes

__all__ = ["DEVICE_COLUMNS", "POOL_COLUMNS", "device_cells", "limit_text", "pool_cells", "render_list"]

POOL_COLUMNS = ("pool", "device", "engine", "model", "pid", "limit", "charged", "mapped", "reserve", "blocks",
                "hit", "state")  # fmt: skip
DEVICE_COLUMNS = ("device", "budget", "charged", "size", "pools")


def limit_text(nbytes: int) -> str:
    return "unlimited" if nbytes == UNLIMITED else format_bytes(nbytes)


def pool_cells(pool: PoolInfo) -> dict[str, str]:
    """One pool's row, by :data:`POOL_COLUMNS` (a pool whose engine has not published yet is "starting")."""
    snap = pool.snapshot
    cells = {
        "pool": pool.name,
        "device": pool.device,
        "engine": pool.engine,
        "model": pool.model,
        "pid": str(pool.pid),
        "limit": limit_text(pool.limit_bytes) if pool.follows_limit else "none (budget only)",
        "charged": format_bytes(pool.charged_bytes),
    }
    if snap is None:
        return {**cells, "mapped": "-", "reserve": "-", "blocks": "-", "hit": "-", "state": "starting"}
    acquisitions = snap.reserve_hits + snap.reserve_misses
    return {
        **cells,
        "mapped": format_bytes(snap.mapped_bytes),
        "reserve": format_bytes(pool.reserved_bytes),
        "blocks": f"{snap.used_blocks}/{snap.total_blocks}",
        "hit": f"{100 * snap.reserve_hit_rate:.0f}%" if acquisitions else "-",
        "state": snap.state.value,
    }


def device_cells(device: DeviceInfo) -> dict[str, str]:
    """One device budget's row, by :data:`DEVICE_COLUMNS`."""
    return {
        "device": device.device,
        "budget": limit_text(device.budget_bytes),
        "charged": format_bytes(device.charged_bytes),
        "size": format_bytes(device.total_bytes) if device.total_bytes else "unknown",
        "pools": str(len(device.pools)),
    }


def _table(columns: Sequence[str], rows: Sequence[dict[str, str]]) -> str:
    header = [c.upper() for c in columns]
    cells = [[row[c] for c in columns] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(header, *cells, strict=False)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in (header, *cells)]  # fmt: skip
    return "\n".join(lines)


def render_list(pools: Sequence[PoolInfo], devices: Sequence[DeviceInfo]) -> str:
    """The plain-text tables of ``kvctl list``: pools, then devices."""
    if not pools and not devices:
        return "no elastic-kv pools"
    parts = [_table(POOL_COLUMNS, [pool_cells(p) for p in pools]) if pools else "no elastic-kv pools"]
    if devices:
        parts.append(_table(DEVICE_COLUMNS, [device_cells(d) for d in devices]))
    return "\n\n".join(parts)
