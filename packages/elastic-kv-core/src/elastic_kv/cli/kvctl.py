"""kvctl: see and steer the elastic-kv pools of this host (``kvctl`` or ``python -m elastic_kv.cli.kvctl``).

One file over 400 lines on purpose: one command, its subcommands and their refusals read in one place
(their tables are :mod:`.table`, the live view :mod:`.top`, the exporter :mod:`.metrics`).

    kvctl list [--json]                 every pool and device budget
    kvctl limit POOL SIZE|PCT|unlimited [--wait SEC] [--force]
                                        a pool's physical limit (PCT of its device's budget, else its size);
                                        --wait: until the pool holds no more than that, and say how long
                                        it took and how many requests the engine preempted meanwhile
    kvctl budget DEVICE [SIZE|PCT|unlimited] [--create] [--force]
                                        show or set a device's GPU-wide budget (PCT of its size); a device
                                        no pool has used yet needs --create (a misspelt name is refused)
    kvctl trim POOL [--wait SEC]        have a pool return its mapped reserve now; print what came back
    kvctl watch [-n SEC] [--count N]    print the list every SEC seconds
    kvctl top [-n SEC] [--count N]      live table
    kvctl metrics [--port N]            Prometheus exposition once, or served on a port

Sizes: 512M, 2GiB, 1.5G, 4096 (units are binary: 1G = 1GB = 1GiB), or a percentage such as 25%.
A negative size (``-5G``) is read as a size, not as an option, and refused as negative. Devices are named
as ``kvctl list`` shows them: ``cpu`` for the host backend, the GPU's UUID (``GPU-...``) for a GPU.

A limit or budget below what a pool's largest unfinished request needs to run alone (its snapshot's
``largest_request_bytes``) is refused in one line (exit 6): under it that request could never run, and its
engine would end it with an error. ``--force`` applies it anyway and warns which requests end so.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from elastic_kv.cli.table import limit_text, render_list
from elastic_kv.errors import ConfigError
from elastic_kv.registry import (
    UNLIMITED,
    PoolInfo,
    Registry,
    UnknownDeviceError,
    UnknownPoolError,
)
from elastic_kv.registry.files import check_device_name
from elastic_kv.sizes import Percent, format_bytes, parse_amount

__all__ = [
    "EXIT_BAD_ARGUMENT",
    "EXIT_REFUSED",
    "EXIT_REGISTRY",
    "EXIT_TIMEOUT",
    "EXIT_UNKNOWN",
    "main",
]

# Exit codes (also in --help): 0 success, 1 unexpected failure.
EXIT_BAD_ARGUMENT = 2  # argparse's own code for usage errors; also bad sizes and percentages
EXIT_UNKNOWN = 3  # no such pool or device
EXIT_REGISTRY = 4  # the registry directory or a file in it cannot be used (ConfigError)
EXIT_TIMEOUT = 5  # limit --wait: the pool did not get under its new limit in time
EXIT_REFUSED = 6  # a limit or budget below what a running request needs (--force applies it)

_UNLIMITED_WORDS = ("unlimited", "none")
# What argparse must take for a (negative) positional value rather than an option: '-5G', '-1.5', '-.5M'.
# argparse's own matcher accepts only bare numbers ('-5'), so '-5G' would be an unknown option.
_NEGATIVE_SIZE = re.compile(r"^-(\d+(\.\d*)?|\.\d+)\s*[A-Za-z%]*$")


class _UsageError(Exception):
    """A well-formed command that cannot be carried out as asked (e.g. a percentage of an unknown size)."""


class _Refused(Exception):
    """A limit or budget under which a request the engine holds could never run (``--force`` overrides)."""


def _largest_request(pool: PoolInfo) -> int:
    """What the pool's largest unfinished request needs to run alone (0: none, or not published)."""
    return pool.snapshot.largest_request_bytes if pool.snapshot is not None else 0


def _starved(pools: Sequence[PoolInfo], nbytes: int) -> list[PoolInfo]:
    """The pools whose largest request needs more than ``nbytes``, the hungriest first."""
    if nbytes == UNLIMITED:
        return []
    return sorted((p for p in pools if _largest_request(p) > nbytes), key=_largest_request, reverse=True)


def _needs(pools: Sequence[PoolInfo]) -> str:
    return ", ".join(f"{p.name} {format_bytes(_largest_request(p))}" for p in pools)


def _amount(text: str, what: str, base: Callable[[], tuple[int, str]]) -> int:
    """Bytes for a SIZE, PCT or 'unlimited' argument; ``base`` gives (bytes, description) for a PCT."""
    if text.strip().lower() in _UNLIMITED_WORDS:
        return UNLIMITED
    amount = parse_amount(text)
    if isinstance(amount, Percent):
        whole, description = base()
        nbytes = amount.of(whole)
    else:
        nbytes = amount
        description = ""
    if nbytes <= 0:
        raise _UsageError(
            f"a {what} of {text}{description} is 0 bytes, which the registry reads as 'unlimited': write "
            "'unlimited' if that is what you mean, or give a positive size"
        )
    return nbytes


def _cmd_list(registry: Registry, args: argparse.Namespace, out: TextIO) -> int:
    pools = registry.pools()
    devices = registry.devices(reclaim=False)
    if args.json:
        doc = {"pools": [p.as_dict() for p in pools], "devices": [d.as_dict() for d in devices]}
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        out.write(render_list(pools, devices) + "\n")
    return 0


def _cmd_limit(registry: Registry, args: argparse.Namespace, out: TextIO) -> int:
    pool = registry.pool(args.pool)

    def base() -> tuple[int, str]:
        device = registry.device(pool.device)
        if device.budget_bytes != UNLIMITED:
            return device.budget_bytes, f" of the {format_bytes(device.budget_bytes)} budget of {pool.device}"
        if device.total_bytes:
            return device.total_bytes, f" of the {format_bytes(device.total_bytes)} of {pool.device}"
        raise _UsageError(
            f"a percentage needs a budget or a known size for device {pool.device}; set one with "
            f"'kvctl budget {pool.device} SIZE', or give the limit in bytes"
        )

    nbytes = _amount(args.size, "limit", base)
    page = pool.snapshot.page_bytes if pool.snapshot is not None else 0
    if nbytes != UNLIMITED and nbytes < page:
        one = format_bytes(page)
        raise _UsageError(
            f"a limit of {format_bytes(nbytes)} is below one page of pool {pool.name} ({one}): the pool "
            f"always backs the page of its null block; give at least {one}"
        )
    starved = _starved([pool], nbytes)
    if starved and not args.force:
        need = format_bytes(_largest_request(pool))
        raise _Refused(
            f"a limit of {format_bytes(nbytes)} is below the {need} that the largest request of pool "
            f"{pool.name} needs to run alone: its engine would end it with an error; give at least {need}, "
            "or add --force to apply the limit anyway"
        )
    updated = registry.set_limit(pool.name, nbytes)
    if starved:
        _warn(
            f"requests of pool {pool.name} that need more than {format_bytes(nbytes)} cannot run under this "
            f"limit and end with an error (the largest needs {format_bytes(_largest_request(pool))})"
        )
    was = limit_text(pool.limit_bytes)
    out.write(
        f"pool {updated.name}: limit {limit_text(updated.limit_bytes)} (was {was}), "
        f"charged {format_bytes(updated.charged_bytes)}, revision {updated.limit_revision}\n"
    )
    over = updated.limit_bytes != UNLIMITED and updated.charged_bytes > updated.limit_bytes
    if over and args.wait <= 0:
        out.write(
            "the pool holds more than that now: it stops growing, and the engine frees the pages to be "
            "released (vLLM preempts, SGLang retracts the requests holding blocks on them)\n"
        )
    # The engine may have shrunk between the change and the read-back: --wait reports what it did either way.
    was_over = nbytes != UNLIMITED and pool.charged_bytes > nbytes
    if args.wait > 0 and (over or was_over):
        return _wait_under_limit(registry, pool, updated, args.wait, out)
    return 0


def _preemptions(pool: PoolInfo) -> int:
    return pool.snapshot.preemptions if pool.snapshot is not None else 0


def _failed(pool: PoolInfo) -> int:
    return pool.snapshot.failed_requests if pool.snapshot is not None else 0


def _cost(before: PoolInfo, now: PoolInfo) -> str:
    """What a limit cost the pool's requests since ``before``: preempted, and ended for needing more."""
    text = f"{_preemptions(now) - _preemptions(before)} request(s) preempted"
    failed = _failed(now) - _failed(before)
    if failed:
        text += f", {failed} ended with an error (they need more than the limit)"
    return text


def _wait_under_limit(
    registry: Registry, before: PoolInfo, pool: PoolInfo, seconds: float, out: TextIO
) -> int:
    """``limit --wait``: poll until the pool is within its limit -- its charge fits and the engine has
    published that it stopped shrinking -- and report how long it took and what it cost: the requests
    the engine preempted meanwhile (``before``: the pool as it was before the limit changed)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        time.sleep(0.05)
        now = registry.pool(pool.name)
        fits = now.charged_bytes <= now.limit_bytes or now.limit_bytes == UNLIMITED
        if fits and (now.snapshot is None or now.snapshot.state != "shrinking"):
            took = time.monotonic() - start
            out.write(
                f"applied after {took:.2f} s: charged {format_bytes(before.charged_bytes)} "
                f"-> {format_bytes(now.charged_bytes)}; {_cost(before, now)}\n"
            )
            return 0
    now = registry.pool(pool.name)
    out.write(
        f"not applied within {seconds:g} s: the pool still holds {format_bytes(now.charged_bytes)} "
        f"(limit {limit_text(now.limit_bytes)}); {_cost(before, now)} so far; it keeps releasing pages as "
        "their blocks are freed\n"
    )
    return EXIT_TIMEOUT


def _cmd_budget(registry: Registry, args: argparse.Namespace, out: TextIO) -> int:
    if args.size is None:
        device = registry.device(args.device)
    else:
        check_device_name(args.device)
        known = {d.device: d for d in registry.devices()}
        if args.device not in known and not args.create:
            names = ", ".join(known) or "none"
            raise UnknownDeviceError(
                f"no pool has used device {args.device!r} (known devices: {names}); check the name with "
                "'kvctl list', or add --create to set a budget before the device's first pool starts"
            )

        def base() -> tuple[int, str]:
            total = known[args.device].total_bytes if args.device in known else 0
            if not total:
                raise _UsageError(
                    f"the size of device {args.device} is unknown until a pool on it starts; give the budget "
                    "in bytes"
                )
            return total, f" of the {format_bytes(total)} of {args.device}"

        nbytes = _amount(args.size, "budget", base)
        starved = _starved([p for p in registry.pools() if p.device == args.device], nbytes)
        if starved and not args.force:
            need = format_bytes(_largest_request(starved[0]))
            raise _Refused(
                f"a budget of {format_bytes(nbytes)} for device {args.device} is below what the largest "
                f"request of pool(s) {_needs(starved)} needs to run alone: its engine would end it with an "
                f"error; give at least {need}, or add --force to apply the budget anyway"
            )
        device = registry.set_budget(args.device, nbytes)
        if starved:
            _warn(
                f"requests that need more than {format_bytes(nbytes)} cannot run under this budget and end "
                f"with an error (largest requests: {_needs(starved)})"
            )
    out.write(
        f"device {device.device}: budget {limit_text(device.budget_bytes)}, charged "
        f"{format_bytes(device.charged_bytes)} by {len(device.pools)} pool(s)\n"
    )
    if device.budget_bytes != UNLIMITED and device.charged_bytes > device.budget_bytes:
        out.write("the pools hold more than that now: none can grow until they release enough\n")
    return 0


def _cmd_trim(registry: Registry, args: argparse.Namespace, out: TextIO) -> int:
    before = registry.pool(args.pool)
    pool = registry.request_trim(args.pool)
    asked = time.time()
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = registry.pool(args.pool)
        # The owner publishes a snapshot as soon as it has applied the request: its answer.
        if now.snapshot is not None and now.snapshot.timestamp >= asked:
            returned = max(0, before.charged_bytes - now.charged_bytes)
            was, left = format_bytes(before.charged_bytes), format_bytes(now.charged_bytes)
            out.write(
                f"pool {now.name}: returned {format_bytes(returned)} (charged {was} -> {left}; reserve "
                f"{now.snapshot.reserve_pages} page(s))\n"
            )
            return 0
    waited = f"no answer in {args.wait:g} s: " if args.wait > 0 else ""
    out.write(
        f"pool {pool.name}: trim requested (revision {pool.trim_revision}); {waited}the engine applies it "
        "when it is next idle or steps\n"
    )
    return 0


def _cmd_watch(registry: Registry, args: argparse.Namespace, out: TextIO) -> int:
    shown = 0
    try:
        while args.count is None or shown < args.count:
            if shown:
                time.sleep(args.interval)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"--- {stamp}\n{render_list(registry.pools(), registry.devices(reclaim=False))}\n")
            out.flush()
            shown += 1
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_top(registry: Registry, args: argparse.Namespace, out: TextIO) -> int:
    from elastic_kv.cli.top import run_top  # rich is imported only for this command

    run_top(registry, interval=args.interval, count=args.count, out=out)
    return 0


def _cmd_metrics(registry: Registry, args: argparse.Namespace, out: TextIO) -> int:
    from prometheus_client import CollectorRegistry, generate_latest

    from elastic_kv.cli.metrics import RegistryCollector, serve

    if args.port is not None:
        logging.getLogger("elastic_kv.cli.metrics").setLevel(logging.INFO)
        serve(args.port, args.addr, registry)
        return 0
    collectors = CollectorRegistry(auto_describe=False)
    collectors.register(RegistryCollector(registry))
    out.write(generate_latest(collectors).decode())
    return 0


_FORCE_HELP = (
    "apply it even below what a pool's largest running request needs (exit 6 otherwise): requests that "
    "need more end with an error"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvctl",
        description="See and steer the elastic-kv pools of this host.",
        epilog="exit codes: 0 ok, 1 unexpected error, 2 bad arguments or sizes, 3 unknown pool or device, "
        "4 registry directory unusable, 5 limit --wait timed out, 6 refused: a limit or budget below what "
        "a running request needs (--force applies it)",
    )
    parser.add_argument(
        "--registry-dir",
        type=Path,
        default=None,
        help="registry directory (default: $ELASTIC_KV_REGISTRY_DIR, else /dev/shm/elastic-kv-UID)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", help="every pool and device budget")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_cmd_list)

    p = sub.add_parser("limit", help="set a pool's physical limit")
    p.add_argument("pool")
    p.add_argument("size", metavar="SIZE|PCT|unlimited", help="e.g. 512M, 2GiB, 25%% (of the device budget)")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SEC",
        help="wait up to SEC seconds until the pool holds no more than the limit (exit 5 if it does not)",
    )
    p.add_argument("--force", action="store_true", help=_FORCE_HELP)
    p.set_defaults(run=_cmd_limit)

    p = sub.add_parser("budget", help="show or set a device's GPU-wide budget")
    p.add_argument("device", help="device name as 'kvctl list' shows it: cpu, or a GPU's UUID (GPU-...)")
    p.add_argument("size", nargs="?", metavar="SIZE|PCT|unlimited", help="e.g. 60GiB, 90%% (of the device)")
    p.add_argument(
        "--create",
        action="store_true",
        help="set the budget of a device no pool has used yet (without it, an unknown name is refused)",
    )
    p.add_argument("--force", action="store_true", help=_FORCE_HELP)
    p.set_defaults(run=_cmd_budget)

    p = sub.add_parser("trim", help="have a pool return its mapped reserve now, and say what came back")
    p.add_argument("pool")
    p.add_argument(
        "--wait", type=float, default=10.0, help="seconds to wait for the pool's answer (default 10; 0: none)"
    )
    p.set_defaults(run=_cmd_trim)

    for name, run, doc in (
        ("watch", _cmd_watch, "print the list periodically"),
        ("top", _cmd_top, "live table"),
    ):
        p = sub.add_parser(name, help=doc)
        p.add_argument(
            "-n", "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
        )
        p.add_argument("--count", type=int, default=None, help="stop after this many refreshes")
        p.set_defaults(run=run)

    p = sub.add_parser("metrics", help="Prometheus metrics: print once, or serve with --port")
    p.add_argument("--port", type=int, default=None, help="serve /metrics on this port until interrupted")
    p.add_argument("--addr", default="127.0.0.1", help="address to bind with --port (default: 127.0.0.1)")
    p.set_defaults(run=_cmd_metrics)
    for subparser in sub.choices.values():
        subparser._negative_number_matcher = _NEGATIVE_SIZE
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run kvctl with ``argv`` (default: ``sys.argv[1:]``), writing to ``out``; return the exit code."""
    stream = sys.stdout if out is None else out
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="kvctl: %(message)s")
    if getattr(args, "interval", 1.0) <= 0:
        return _fail(EXIT_BAD_ARGUMENT, "the interval must be positive")
    try:
        registry = Registry(args.registry_dir)
        code: int = args.run(registry, args, stream)
        return code
    except (UnknownPoolError, UnknownDeviceError) as exc:
        return _fail(EXIT_UNKNOWN, str(exc))
    except ConfigError as exc:
        return _fail(EXIT_REGISTRY, str(exc))
    except (ValueError, _UsageError) as exc:
        return _fail(EXIT_BAD_ARGUMENT, str(exc))
    except _Refused as exc:
        return _fail(EXIT_REFUSED, f"refused: {exc}")
    except BrokenPipeError:  # `kvctl list | head`
        return 0


def _fail(code: int, message: str) -> int:
    print(f"kvctl: {message}", file=sys.stderr)
    return code


def _warn(message: str) -> None:
    print(f"kvctl: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
