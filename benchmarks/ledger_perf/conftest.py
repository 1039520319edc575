"""Collects the per-block cost of each allocator in the run and prints elastic/native ratios at the end."""

from __future__ import annotations

import pytest

_RESULTS = pytest.StashKey[dict[tuple[str, int], float]]()


@pytest.fixture
def record_per_block(request: pytest.FixtureRequest):
    """Call with (allocator name, blocks per call, the finished benchmark fixture)."""
    results = request.config.stash.setdefault(_RESULTS, {})

    def record(name: str, n: int, benchmark) -> None:
        """``n`` blocks per round; negative for the decode case (|n| calls of one block, one free)."""
        stats = benchmark.stats.stats
        results[(name, n)] = stats.median / abs(n)
        benchmark.extra_info["per_block_ns"] = round(stats.median / abs(n) * 1e9, 1)

    return record


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, {})
    sizes = sorted({n for _, n in results}, key=abs)
    if not sizes:
        return
    terminalreporter.section("ledger vs vLLM BlockPool: alloc+free per block (median)")
    for n in sizes:
        native, ours = results.get(("vllm", n)), results.get(("ledger", n))
        if native is None or ours is None:
            continue
        case = f"decode step ({-n} x alloc(1), one free)" if n < 0 else f"alloc({n}) + free"
        terminalreporter.write_line(
            f"{case:36s}: ledger {ours * 1e9:7.1f} ns/block, vLLM BlockPool {native * 1e9:7.1f} ns/block, "
            f"ratio {ours / native:.2f}x"
        )
