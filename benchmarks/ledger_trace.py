"""How many pages stay backed on a realistic serving trace, for several page-selection rules.

    python -m benchmarks.ledger_trace [--steps 20000] [--seed 0]

A small vLLM-like scheduler drives the real ledger (host data plane): requests arrive (Poisson, a rate
that rises and falls like a day of traffic), their prompts are allocated at admission (lognormal
lengths, 16-token blocks), each running request gains one token per step (a new block every 16 tokens),
finished requests free their blocks, and a request that cannot grow is preempted (freed, requeued).
Every rule sees the same arrivals. Reported per rule, averaged over the steps:

* ``used pages``: pages holding at least one live block (what the rule controls);
* ``backed pages``: used + reserve + pending (what the device holds);
* ``fill``: live blocks / (used pages * blocks per page);
* ``maps``/``unmaps``: data-plane calls (driver work), and the reserve hit rate;
* ``quiet``: backed pages in the quietest 5% of the trace (how much memory comes back when load falls).

Rules (the selection among *partly used* pages; empty backed pages come next, new pages last):

* ``seed``        best fit: the smallest page that holds the whole run, else the emptiest page;
* ``best-fullest`` best fit, else the fullest page (fewest free blocks) first;
* ``fullest``     always the fullest page first, whatever the run length;
* ``lowest-id``   the partly used page with the lowest id (address-ordered first fit);
* ``reserve-first`` empty backed pages before partly used ones (the literal order of the brief).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_book import USED, PageBook
from elastic_kv.ledger.page_mapper import LocalMapper

KIB = 1024
TOKENS_PER_BLOCK = 16


class _RuleBook(PageBook):
    """A page book whose partial-page choice is replaced (benchmark only: overrides its internals)."""

    def take_fit(self, n: int) -> list[int] | None:
        return None  # no best-fit fast path: every choice goes through the rule in take_blocks


class BestFullest(_RuleBook):
    @staticmethod
    def _pick_bucket(mask: int, left: int) -> int:
        fit = mask >> left
        return left + ((fit & -fit).bit_length() - 1) if fit else (mask & -mask).bit_length() - 1


class Fullest(_RuleBook):
    @staticmethod
    def _pick_bucket(mask: int, left: int) -> int:
        return (mask & -mask).bit_length() - 1


class LowestId(_RuleBook):
    def take_blocks(self, n: int) -> tuple[list[int], int]:
        # O(pages) scan per page taken: fine for a benchmark, not for the engine's hot path.
        out: list[int] = []
        left = n
        while left and self.mask:
            page = min(p for bucket in self.buckets if bucket for p in bucket)
            k = self.page_bucket[page]
            self.unbucket(page)
            take = min(k, left)
            free = self.page_free[page]
            out += free[-take:]
            del free[-take:]
            left -= take
            if free:
                self.rebucket(page)
            for b in out[-take:]:
                self.live[b] = 1
            self.free_backed -= take
        if left:
            rest, acquired = super().take_blocks(left)
            return out + rest, acquired
        return out, 0


class ReserveFirst(_RuleBook):
    def take_blocks(self, n: int) -> tuple[list[int], int]:
        out: list[int] = []
        acquired = 0
        while n - len(out) >= 1 and (self.reserve or self.pending_epoch):
            if self.pending_epoch:
                page, _ = self.pending_epoch.popitem()
            else:
                page = self.reserve.pop()
            self.state[page] = USED
            acquired += 1
            free = self.page_free[page]
            take = min(n - len(out), len(free))
            got = free[-take:]
            del free[-take:]
            for b in got:
                self.live[b] = 1
            out += got
            self.free_backed -= take
            if free:
                self.rebucket(page)
        if len(out) < n:
            rest, more = super().take_blocks(n - len(out))
            return out + rest, acquired + more
        return out, acquired


RULES: dict[str, type[PageBook]] = {
    "seed": PageBook,
    "best-fullest": BestFullest,
    "fullest": Fullest,
    "lowest-id": LowestId,
    "reserve-first": ReserveFirst,
}


@dataclass
class Request:
    prompt: int
    output: int
    blocks: list[int] = field(default_factory=list)
    tokens: int = 0


def arrivals(steps: int, seed: int, peak: float) -> list[list[tuple[int, int]]]:
    """Per step, the (prompt tokens, output tokens) of the requests that arrive."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        # two "days": the rate swings between 0.01 and `peak` requests per step
        rate = 0.01 + (peak - 0.01) * (0.5 - 0.5 * math.cos(4 * math.pi * step / steps))
        count = 0
        limit = math.exp(-rate)
        p = rng.random()
        while p > limit:  # Poisson draw (Knuth)
            count += 1
            p *= rng.random()
        out.append(
            [
                (
                    min(8192, max(16, int(rng.lognormvariate(6.4, 1.0)))),
                    min(2048, max(1, int(rng.lognormvariate(5.3, 0.8)))),
                )
                for _ in range(count)
            ]
        )
    return out


@dataclass
class Result:
    used_pages: float = 0.0
    backed_pages: float = 0.0
    fill: float = 0.0
    after_drain: float = 0.0
    maps: int = 0
    unmaps: int = 0
    hit_rate: float = 0.0
    preemptions: int = 0
    finished: int = 0


def run(rule: str, trace: list[list[tuple[int, int]]], num_blocks: int) -> Result:
    geo = BlockGeometry.from_layer_strides(num_blocks * 2 * KIB, num_blocks, 1, 0, 2 * KIB, 2 * KIB, 64 * KIB)
    backend = _vmm.HostBackend(granularity=64 * KIB)
    mapper = LocalMapper.for_geometry(backend, geo)
    cfg = ElasticConfig(page_size=64 * KIB, reserve_min_pages=2, reserve_max_pages=8)
    led = Ledger(geo, mapper, cfg, book_type=RULES[rule])
    bpp = geo.blocks_per_page
    waiting: list[Request] = []
    running: dict[int, Request] = {}
    due: list[tuple[int, int]] = []  # (step at which the request needs its next block, request id)
    done_at: list[tuple[int, int]] = []
    res = Result()
    next_id = 0
    steps = len(trace)
    trough = {s for s in range(steps) if min(s % (steps // 2), steps // 2 - s % (steps // 2)) < steps // 40}

    def release(rid: int) -> Request:
        req = running.pop(rid)
        led.free(req.blocks)
        req.blocks = []
        return req

    for step, new in enumerate(trace):
        waiting += [Request(p, o) for p, o in new]
        # finish
        while done_at and done_at[0][0] <= step:
            _, rid = heapq.heappop(done_at)
            if rid in running:
                release(rid)
                res.finished += 1
        # decode: requests crossing a block boundary need one more block
        while due and due[0][0] <= step:
            _, rid = heapq.heappop(due)
            if rid not in running:
                continue
            req = running[rid]
            got = led.alloc(1)
            while got is None and len(running) > 1:  # preempt the newest other request
                victim = max(r for r in running if r != rid)
                waiting.insert(0, release(victim))
                res.preemptions += 1
                got = led.alloc(1)
            if got is None:
                continue
            req.blocks += got
            heapq.heappush(due, (step + TOKENS_PER_BLOCK, rid))
        # admit (FCFS) while the prompt fits
        while waiting:
            req = waiting[0]
            need = -(-req.prompt // TOKENS_PER_BLOCK)
            if need > led.available_size():
                break
            got = led.alloc(need)
            if got is None:
                break
            waiting.pop(0)
            req.blocks = got
            rid, next_id = next_id, next_id + 1
            running[rid] = req
            first_boundary = need * TOKENS_PER_BLOCK - req.prompt
            heapq.heappush(due, (step + first_boundary + 1, rid))
            heapq.heappush(done_at, (step + req.output, rid))
        led.maintain()
        led.settle()  # a GPU step takes milliseconds: the background maps queued this step have landed
        snap = led.snapshot()
        used = snap.mapped_pages - snap.reserve_pages - snap.pending_pages
        res.used_pages += used
        res.backed_pages += snap.mapped_pages
        res.fill += snap.used_blocks / (used * bpp) if used else 1.0
        if step in trough:  # the quietest 5% of the trace: how much stays backed when load is low
            res.after_drain += snap.mapped_pages
    res.after_drain = round(res.after_drain / len(trough))
    res.used_pages /= steps
    res.backed_pages /= steps
    res.fill /= steps
    res.maps, res.unmaps = backend.calls("map"), backend.calls("unmap")
    res.hit_rate = led.reserve_hit_rate
    led.close()
    mapper.close()
    return res


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=8192, help="pool size in 16-token blocks")
    parser.add_argument("--peak", type=float, default=0.3, help="peak arrivals per step")
    parser.add_argument("--rules", default=",".join(RULES))
    args = parser.parse_args(argv)
    trace = arrivals(args.steps, args.seed, args.peak)
    out(f"{args.steps} steps, {sum(map(len, trace))} requests, {args.blocks} blocks of 32 per page")
    out(f"{'rule':14s} {'used pages':>10s} {'backed':>8s} {'fill':>6s} {'quiet':>8s} "
        f"{'maps':>7s} {'unmaps':>7s} {'hits':>6s} {'preempt':>8s} {'done':>6s}")  # fmt: skip
    for rule in args.rules.split(","):
        r = run(rule, trace, args.blocks)
        out(
            f"{rule:14s} {r.used_pages:10.1f} {r.backed_pages:8.1f} {r.fill:6.3f} {r.after_drain:8.0f} "
            f"{r.maps:7d} {r.unmaps:7d} {r.hit_rate:6.3f} {r.preemptions:8d} {r.finished:6d}"
        )


if __name__ == "__main__":
    main()
