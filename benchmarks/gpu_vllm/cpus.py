"""CPU cores of the GPU proof's processes (``--pin``): both engines on the same cores (``shared``, the
default: one bursts while the other idles) or on cores of their own (``split``), the parent on the rest;
``none`` pins nothing. Whole physical cores only: hyper-thread siblings stay together."""

from __future__ import annotations

import os
from pathlib import Path


def core_groups() -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (hyper-thread siblings together)."""
    allowed = sorted(os.sched_getaffinity(0))
    groups: dict[str, list[int]] = {}
    for cpu in allowed:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        except OSError:
            siblings = str(cpu)
        groups.setdefault(siblings.strip(), []).append(cpu)
    return sorted(groups.values())


def cpu_split(mode: str) -> dict[str, list[int]] | None:
    """CPUs (whole physical cores) for each engine and for this process (see ``--pin``); None when pinning
    is off or there are too few cores to give each engine three."""
    cores = core_groups()
    each = (len(cores) - 1) // 2
    if mode == "none" or each < 3:
        return None
    parts = (cores[:each], cores[each : 2 * each], cores[2 * each :])
    if mode == "shared":
        parts = (cores[: 2 * each], cores[: 2 * each], cores[2 * each :])
    first, second, parent = (sorted(c for core in part for c in core) for part in parts)
    return {"A": first, "B": second, "parent": parent}
