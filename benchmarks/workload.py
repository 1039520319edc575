"""The command line of the vLLM scheduler and throughput benchmarks: the workload they share, ``--requests``
prompts of ``--prompt`` tokens, each generating ``--output`` tokens. Each script adds its own options."""

from __future__ import annotations

import argparse

__all__ = ["workload_parser"]


def workload_parser(doc: str, *, requests: int, output: bool = True) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc`` with ``--requests`` (default ``requests``),
    ``--prompt`` (256 tokens) and, unless ``output`` is false, ``--output`` (128 tokens)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--prompt", type=int, default=256)
    if output:
        parser.add_argument("--output", type=int, default=128)
    return parser
