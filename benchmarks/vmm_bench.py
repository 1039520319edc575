"""Cost of growing and shrinking a KV pool: elastic_kv._vmm against the bare driver loop, in one run.

For each page size it times, per 2 MiB-equivalent page and per GiB:

* raw fresh   -- the driver floor without a pool: create + map + set_access / unmap + release per handle
* raw pooled  -- the floor with handles created beforehand: map + set_access / unmap
* ours fresh  -- SpaceGroup.map / unmap with a HandlePool that caches nothing (every map creates)
* ours pooled -- the same with a warm HandlePool (unmap -> map cycles reuse handles)

"ours" also swaps the zero page in and out (map = unmap zero + map + set_access; unmap = unmap + map zero +
set_access zero), which the raw loop does not; unmaps of adjacent units are coalesced into one call when the
backend supports it (backend.multi_unmap, probed on CUDA). Compound settings keep 2 MiB slots but give each
logical page one handle of the page's size (the layout elastic-kv uses when a page's bytes are contiguous).

Goals (docs/ARCHITECTURE.md, issue 2): pooled 2 MiB growth within 1.1x of the raw pooled floor; a large-page
setting at or under 3 ms/GiB.

    python benchmarks/vmm_bench.py --backend cuda            # on the GPU machine
    python benchmarks/vmm_bench.py --backend host --gib 0.25 # anywhere (host virtual memory)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from elastic_kv import _vmm

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Row:
    """One measured configuration; times are medians over the repeats, in seconds for the whole batch."""

    setting: str
    page_mib: int
    handle_mib: int
    pages: int
    grow_s: float
    shrink_s: float

    @property
    def gib(self) -> float:
        return self.pages * self.page_mib * MiB / GiB

    def grow_ms_per_gib(self) -> float:
        return self.grow_s * 1e3 / self.gib

    def shrink_ms_per_gib(self) -> float:
        return self.shrink_s * 1e3 / self.gib

    def grow_us_per_2mib(self) -> float:
        return self.grow_s * 1e6 / (self.gib * GiB / (2 * MiB))

    def shrink_us_per_2mib(self) -> float:
        return self.shrink_s * 1e6 / (self.gib * GiB / (2 * MiB))


def make_backend(kind: str, device: int) -> _vmm.Backend:
    if kind == "cuda":
        return _vmm.CudaBackend(device)
    if kind == "host":
        return _vmm.HostBackend(granularity=2 * MiB)
    raise SystemExit(f"unknown backend {kind!r}")


def median_of(repeat: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    results = [run() for _ in range(repeat)]
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def raw(
    backend: _vmm.Backend, handle: int, count: int, pooled: bool, repeat: int
) -> tuple[Row, dict[str, float]]:
    calls: dict[str, list[float]] = {}

    def once() -> tuple[float, float]:
        backend.synchronize()
        t = _vmm.raw_driver_loop(backend, handle, count, pooled)
        for key in ("create_s", "map_s", "set_access_s", "unmap_s", "release_s"):
            calls.setdefault(key, []).append(t[key] / count)
        return t["grow_s"], t["shrink_s"]

    grow, shrink = median_of(repeat, once)
    per_call = {k: statistics.median(v) * 1e6 for k, v in calls.items()}
    name = "raw pooled" if pooled else "raw fresh"
    return Row(name, handle // MiB, handle // MiB, count, grow, shrink), per_call


def ours(backend: _vmm.Backend, page: int, slot: int, count: int, pooled: bool, repeat: int) -> Row:
    space = _vmm.TensorSpace(backend, count * page, slot)
    pool = _vmm.HandlePool(backend, count * page if pooled else 0)
    group = _vmm.SpaceGroup([space], [(0, 0, page, page)], count, pool)
    pages = list(range(count))
    if pooled:  # warm the pool: the steady state of a pool that grows and shrinks
        group.map(pages)
        group.unmap(pages)

    def once() -> tuple[float, float]:
        backend.synchronize()
        t0 = time.perf_counter()
        group.map(pages)
        t1 = time.perf_counter()
        group.unmap(pages)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    grow, shrink = median_of(repeat, once)
    group.close()
    pool.trim(0)
    name = ("ours pooled" if pooled else "ours fresh") + (" (compound)" if page != slot else "")
    return Row(name, page // MiB, page // MiB, count, grow, shrink)


def print_table(rows: list[Row], floors: dict[tuple[int, str], Row]) -> None:
    header = (
        f"{'setting':<24}{'page':>7}{'pages':>7}{'grow ms/GiB':>13}{'us/2MiB':>9}{'x floor':>9}"
        f"{'shrink ms/GiB':>15}{'us/2MiB':>9}{'x floor':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        kind = "raw pooled" if "pooled" in r.setting else "raw fresh"
        floor = floors.get((r.handle_mib, kind))
        gx = f"{r.grow_s / floor.grow_s:8.2f}x" if floor and not r.setting.startswith("raw") else f"{'':9}"
        sx = (
            f"{r.shrink_s / floor.shrink_s:8.2f}x" if floor and not r.setting.startswith("raw") else f"{'':9}"
        )
        print(
            f"{r.setting:<24}{r.page_mib:>5}Mi{r.pages:>7}"
            f"{r.grow_ms_per_gib():>13.2f}{r.grow_us_per_2mib():>9.1f}{gx}{r.shrink_ms_per_gib():>15.2f}{r.shrink_us_per_2mib():>9.1f}{sx}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--gib", type=float, default=1.0, help="how much to grow and shrink per measurement")
    parser.add_argument("--page-mib", default="2,32,64", help="page sizes to measure (MiB, comma separated)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    backend = make_backend(args.backend, args.device)
    granularity = backend.granularity
    facts = f"backend {backend.name} {backend.device}, granularity {granularity // 1024} KiB, "
    facts += f"multi_unmap {backend.multi_unmap}"
    if isinstance(backend, _vmm.CudaBackend):
        facts += f", driver {backend.driver_version}"
    print(facts)
    free, total = backend.mem_info()
    print(f"memory: {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB")
    print(f"{args.gib} GiB grown and shrunk per measurement, median of {args.repeat}")
    print()

    rows: list[Row] = []
    floors: dict[tuple[int, str], Row] = {}
    per_call: dict[int, dict[str, float]] = {}
    for page_mib in (int(x) for x in args.page_mib.split(",")):
        page = page_mib * MiB
        if page % granularity:
            print(f"skipping {page_mib} MiB: not a multiple of the granularity", file=sys.stderr)
            continue
        count = max(1, int(args.gib * GiB) // page)
        for pooled in (False, True):
            row, calls = raw(backend, page, count, pooled, args.repeat)
            rows.append(row)
            floors[(page_mib, row.setting)] = row
            if not pooled:
                per_call[page_mib] = calls
        rows.append(ours(backend, page, page, count, False, args.repeat))
        rows.append(ours(backend, page, page, count, True, args.repeat))
        if page != granularity:  # the same page as a compound unit over granularity-sized slots
            rows.append(ours(backend, page, granularity, count, True, args.repeat))

    print_table(rows, floors)
    print()
    print("driver calls, us per call (raw fresh loop):")
    for page_mib, calls in per_call.items():
        detail = "  ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in calls.items())
        print(f"  {page_mib:>3} MiB: {detail}")
    print()

    def find(setting: str, page_mib: int) -> Row | None:
        return next((r for r in rows if r.setting == setting and r.page_mib == page_mib), None)

    ours2, floor2 = find("ours pooled", 2), find("raw pooled", 2)
    if ours2 and floor2:
        ratio = ours2.grow_s / floor2.grow_s
        verdict = "met" if ratio <= 1.1 else "NOT met"
        print(
            f"goal 1: pooled 2 MiB growth {ours2.grow_ms_per_gib():.2f} ms/GiB vs raw pooled floor "
            f"{floor2.grow_ms_per_gib():.2f} ms/GiB = {ratio:.2f}x (goal <= 1.10x): {verdict}"
        )
    large = [r for r in rows if r.setting.startswith("ours pooled") and r.page_mib >= 32]
    if large:
        best = min(large, key=lambda r: r.grow_s / r.gib)
        verdict = "met" if best.grow_ms_per_gib() <= 3.0 else "NOT met"
        print(
            f"goal 2: best large-page growth {best.grow_ms_per_gib():.2f} ms/GiB ({best.setting}, "
            f"{best.page_mib} MiB pages) (goal <= 3 ms/GiB): {verdict}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"facts": facts, "rows": [asdict(r) for r in rows], "per_call_us": per_call}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
